"""The promotion as Prefect tasks: stage a candidate (deploy), switch to it (switch), or abandon it.

The flow runs stage → benchmark → gate on the candidate's own ports, before it gets traffic; then
``switch`` moves the stable endpoint to it, watches it and retires the old backend. When anything
fails before the switch, ``abandon_candidate`` removes the candidate (the old backend never stopped
serving) and writes ``<run_dir>/rollback.json`` for the manifest and report.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from stoker.deploy import rollout
from stoker.triton import metrics as triton_metrics
from stoker.atomic import write_atomic
from stoker.run import RunContext, StepResult
from stoker.spec.schema import Spec

from . import step_task

ROLLBACK_FILE = "rollback.json"
FAILED_EVENT = "stoker.run.failed"


@step_task("deploy", retries=0)
def stage_candidate(spec: Spec, uploaded: StepResult, ctx: RunContext, repository: str | None = None) -> StepResult:
    """Reconcile the deployment, then start and prove a candidate for the uploaded repository (no traffic yet).

    ``repository``: where the backend loads it from, as the target says (stoker/targets/: S3, or the package
    step's folder mounted into a GPU backend); the upload's S3 URI by default."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    staged = rollout.stage(spec, repository or uploaded.detail["repository_uri"], uploaded.digest, ctx.run_id,
                           logger.info, standin=ctx.standin, gpu=ctx.gpu)
    cand = staged["candidate"]
    # http/grpc/metrics: the candidate's own ports, which the benchmark and gates use before the switch.
    detail = {**staged, "http": cand["http"], "grpc": cand["grpc"], "metrics": cand["metrics"],
              "container": cand["container"]}
    return StepResult(name="deploy", cache_hit=bool(staged["reused"]), duration_s=time.perf_counter() - t0,
                      key=uploaded.digest[:24], digest=uploaded.digest, detail=detail)


@step_task("gpu-rollout")
def decide_gpu_rollout(spec: Spec, fetched: StepResult, ctx: RunContext) -> StepResult:
    """The run's GPU decision, once, from the fetched files and the GPUs the live backend holds
    (stoker/gpu/decision.py): build, package, stage and the manifest use it."""
    from stoker.containers import engine as docker_engine
    from stoker.gpu import decision

    t0 = time.perf_counter()
    held = rollout.held_gpus(docker_engine.connect(spec.deploy.docker_host), spec)
    decided = decision.from_fetch(spec, Path(fetched.path), held)
    planned = decision.planned(decided)
    get_run_logger().info(f"GPU rollout: {planned.note() if planned else 'not estimated (model facts unknown)'}; "
                          f"the candidate and its build get GPUs {decided['candidate']}"
                          + (f" (the live backend holds {decided['held']})" if decided["held"] else ""))
    return StepResult(name="gpu-rollout", duration_s=time.perf_counter() - t0, detail=decided)


def settle_gpu_rollout(spec: Spec, ctx: RunContext) -> dict:
    """Under the deploy lock: the candidate's GPUs (and the baseline's) from what serves now, once; staging uses
    them as recorded (stoker/gpu/decision.py settle)."""
    from stoker.containers import engine as docker_engine
    from stoker.gpu import decision

    held = rollout.held_gpus(docker_engine.connect(spec.deploy.docker_host), spec)
    settled = decision.settle(spec, ctx.gpu, held)
    if settled["candidate"] != ctx.gpu.get("candidate"):
        get_run_logger().info(f"GPU rollout: what serves changed since the fetch (now on {list(held)}): the "
                              f"candidate gets GPUs {settled['candidate']}")
    return settled


@step_task("switch", retries=0)
def switch_traffic(spec: Spec, staged: StepResult, ctx: RunContext) -> StepResult:
    """The stable endpoint moves to the candidate; watched; the old backend retires, or traffic goes back."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    try:
        done = rollout.go_live(spec, staged.detail, logger.info)
    except rollout.promote.PromotionFailed as exc:
        record(ctx, {"action": str(exc), "status": exc.status, "from": staged.digest})
        raise
    return StepResult(name="switch", cache_hit=not done["switched"], duration_s=time.perf_counter() - t0,
                      digest=staged.digest, detail=done)


def abandon_candidate(spec: Spec, staged: StepResult, ctx: RunContext, cause: str) -> None:
    """A step between staging and the switch failed: the candidate never serves."""
    logger = get_run_logger()
    # When and how long: the removal is the run's own work (stopping a container), not orchestration overhead.
    rec = {"from": staged.digest, "cause": cause, "began_at": time.time()}
    t0 = time.perf_counter()
    try:
        rec.update(action=rollout.abandon(spec, staged.detail, logger.info), status="rolled back")
    except Exception as exc:  # noqa: BLE001 - the run already failed; the record says the cleanup did too
        rec.update(action="candidate removal failed", status="failed", error=f"{type(exc).__name__}: {exc}")
        logger.error(f"could not remove the candidate: {exc}")
    rec["duration_s"] = round(time.perf_counter() - t0, 3)
    record(ctx, rec)


@step_task("remove", retries=0)
def remove_candidate(spec: Spec, staged: StepResult, ctx: RunContext) -> StepResult:
    """A candidate staged only to be measured (a bf16 baseline): removed, never served; the live build untouched."""
    t0 = time.perf_counter()
    action = rollout.abandon(spec, staged.detail, get_run_logger().info)
    return StepResult(name="remove", duration_s=time.perf_counter() - t0, detail={"action": action})


def record(ctx: RunContext, rec: dict) -> None:
    rec.setdefault("at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    write_atomic(Path(ctx.run_dir) / ROLLBACK_FILE, json.dumps(rec, indent=1))


def read_rollback(ctx: RunContext) -> dict | None:
    path = ctx.run_dir / ROLLBACK_FILE
    return json.loads(path.read_text()) if path.exists() else None


@task(name="scrape-metrics", cache_policy=NO_CACHE, persist_result=False)
def scrape_metrics(deployed: StepResult) -> list[dict]:
    """Triton's counters per model (requests, queue and compute time) for the report; [] when unreachable."""
    url = deployed.detail.get("metrics")
    if not url:
        return []
    try:
        return triton_metrics.scrape(url)
    except OSError as exc:
        get_run_logger().warning(f"metrics not scraped from {url}: {exc}")
        return []


def emit_failure(spec: Spec, ctx: RunContext, error: str, rollback: dict | None, status: str = "failed") -> None:
    """A Prefect event automations can match (deployments/automations/notify-on-failure.yaml); ``status``: failed
    or cancelled."""
    emit_event(
        FAILED_EVENT,
        resource={"prefect.resource.id": f"stoker.deployment.{spec.deploy.name}",
                  "prefect.resource.name": spec.deploy.name},
        payload={"run_id": ctx.run_id, "status": status, "error": error, "repo_id": spec.model.repo_id,
                 "revision": spec.model.revision,
                 "rollback": (rollback or {}).get("action"), "rollback_status": (rollback or {}).get("status")},
    )
