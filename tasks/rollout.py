"""deploy with a rollout strategy (replace | reload), its rollback hook, the health gate, metrics, failure events.

The flow runs deploy → verify → benchmark (→ gate) inside one Prefect transaction:
when anything after deploy raises, Prefect calls ``undo_rollout`` (deploy's
on_rollback hook), which returns the endpoint to what served before and writes
``<run_dir>/rollback.json`` for the manifest and report.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.transactions import get_transaction

from stoker import rollout, triton_metrics
from stoker.manifest import write_atomic
from stoker.run import RunContext, StepResult
from stoker.spec import Spec
from stoker.triton_config import ENSEMBLE_NAME

from . import step_task

ROLLBACK_FILE = "rollback.json"
FAILED_EVENT = "stoker.run.failed"


@step_task("deploy", retries=0)
def deploy_endpoint(spec: Spec, uploaded: StepResult, ctx: RunContext) -> StepResult:
    """Serve the uploaded repository with the spec's rollout strategy; remembers what served before."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    done = rollout.rollout(spec, uploaded.detail["repository_uri"], uploaded.digest, logger.info)
    txn = get_transaction()
    if txn is not None:  # the rollback hook reads these
        txn.set("spec", spec.model_dump(mode="json"))
        txn.set("rollout", done)
        txn.set("run_dir", str(ctx.run_dir))
    detail = {k: done.get(k) for k in ("strategy", "container", "container_id", "http", "grpc", "metrics",
                                       "replaced", "previous", "version", "previous_version", "load_s")}
    detail["image"] = spec.deploy.image
    return StepResult(name="deploy", cache_hit=bool(done["reused"]), duration_s=time.perf_counter() - t0,
                      key=uploaded.digest[:24], digest=uploaded.digest, detail=detail)


@deploy_endpoint.on_rollback
def undo_rollout(txn) -> None:
    """Prefect calls this when a later step in the deploy transaction fails."""
    from stoker.spec import parse_spec

    logger = get_run_logger()
    done, run_dir = txn.get("rollout"), txn.get("run_dir")
    spec = parse_spec(txn.get("spec"), "spec")
    record = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "from": done.get("digest")}
    if not spec.deploy.auto_rollback:
        record.update(action="none (deploy.auto_rollback is false)", status="skipped")
    else:
        try:
            record.update(rollout.roll_back(spec, done, logger.info), status="rolled back")
        except Exception as exc:  # noqa: BLE001 - the run already failed; the record says the rollback did too
            record.update(action="rollback failed", status="failed", error=f"{type(exc).__name__}: {exc}")
            logger.error(f"rollback failed: {exc}")
    write_atomic(Path(run_dir) / ROLLBACK_FILE, json.dumps(record, indent=1))


def read_rollback(ctx: RunContext) -> dict | None:
    path = ctx.run_dir / ROLLBACK_FILE
    return json.loads(path.read_text()) if path.exists() else None


@step_task("verify", retries=0)
def verify_endpoint(spec: Spec, deployed: StepResult, prompt: str = "Hello") -> StepResult:
    """Health gate after the rollout: ready, and one real streamed generation through the ensemble."""
    t0 = time.perf_counter()
    http = deployed.detail["http"]
    body = json.dumps({"text_input": prompt, "max_tokens": 4, "stream": True}).encode()
    req = urllib.request.Request(f"{http}/v2/models/{ENSEMBLE_NAME}/generate_stream", data=body, method="POST")
    try:
        with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=10):
            pass
        with urllib.request.urlopen(req, timeout=spec.benchmark.timeout_s) as resp:
            events = [json.loads(ln[5:]) for ln in resp.read().decode().splitlines() if ln.startswith("data:")]
    except OSError as exc:
        raise rollout.RolloutError(f"health gate: {http} failed: {exc}") from None
    errors = [e["error"] for e in events if "error" in e]
    if not events or errors:
        raise rollout.RolloutError(f"health gate: generation failed: {errors[0] if errors else 'no output'}")
    return StepResult(name="verify", duration_s=time.perf_counter() - t0, detail={"events": len(events)})


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


def emit_failure(spec: Spec, ctx: RunContext, error: str, rollback: dict | None) -> None:
    """A Prefect event automations can match (deployments/automations/notify-on-failure.yaml)."""
    emit_event(
        FAILED_EVENT,
        resource={"prefect.resource.id": f"stoker.deployment.{spec.deploy.name}",
                  "prefect.resource.name": spec.deploy.name},
        payload={"run_id": ctx.run_id, "error": error, "repo_id": spec.model.repo_id,
                 "revision": spec.model.revision,
                 "rollback": (rollback or {}).get("action"), "rollback_status": (rollback or {}).get("status")},
    )
