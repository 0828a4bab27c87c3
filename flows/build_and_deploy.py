"""build_and_deploy: (preflight) fetch → eval-data → build → package → upload → deploy → benchmark → baseline →
evaluate → gate → promote.

The target (stoker/targets/) supplies the steps between fetch and promote. reference: quantize → build
→ package; GPU targets: one cached GPU "build" step, then package. Then, for every target, "deploy" stages a
candidate behind the deployment's stable endpoint, the benchmark and its gates run on the candidate's own ports,
and only a candidate that passed them gets traffic ("switch"): stoker/serving, one path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from flows.target_tasks import TargetTasks
from stoker.errors import one_line
from stoker.gpu import standin
from stoker.orchestration.exclusive import deploy_lock, exclusive, host_lock
from stoker.record.manifest import build_manifest, write_atomic, write_local
from stoker.record.report import benchmark_rows, markdown
from stoker.run import RunContext, StepResult
from stoker.spec.schema import Spec
from stoker.spec.load import target_of
from tasks.evaluate import evaluation_data
from tasks.fleet import fleet_preflight, roll_fleet
from tasks.gate import promote_run
from tasks.hub import fetch_adapters, fetch_weights
from tasks.preflight import preflight_checks, refuse_rolled_back
from tasks.ordering import refuse_older_run
from tasks.rollout import emit_failure, read_rollback
from tasks.routing import mark_routed, route_heavy_steps
from tasks.s3 import store_manifest, upload_repository



def ended(exc: BaseException) -> str:
    """How a run or step that raised ``exc`` ended: "failed", or "cancelled" for what is not an error of its own
    (Prefect's TerminationSignal when the run is cancelled, Abort, KeyboardInterrupt, SystemExit)."""
    return "failed" if isinstance(exc, Exception) else "cancelled"


class Steps(dict[str, StepResult]):
    """Runs each step, keeping a failed step's duration and one-line cause for the manifest."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks = TargetTasks()  # what the target's steps run (stoker.targets.base.Tasks)
        self.metrics: list[dict] = []  # set by the target's evaluate, kept when a later step fails
        self.evaluation: dict | None = None  # likewise: the accuracy evaluation, even when its gate failed

    def run(self, name: str, task: Callable[..., StepResult], *args) -> StepResult:
        t0, began = time.perf_counter(), time.time()
        try:
            result = task(*args)
        except BaseException as exc:  # a cancelled run (Prefect's TerminationSignal) is recorded too
            self[name] = StepResult(name=name, status=ended(exc), duration_s=time.perf_counter() - t0,
                                    error=one_line(exc) or type(exc).__name__, started_at=began)
            raise
        if result.started_at is None:  # a step that began elsewhere (a task future) says when itself
            result.started_at = began
        self[name] = result
        return result


@flow(name="build_and_deploy", log_prints=True)
def build_and_deploy(spec: Spec, home: str | None = None, force: bool = False) -> dict:
    """Turn the spec's model revision into a benchmarked Triton endpoint; returns the run manifest. ``force``:
    deploy it even if `stoker rollback` rolled this spec's build at this commit back."""
    # The stand-in (STOKER_STANDIN) is decided here, once, and recorded: every step reads ctx.standin.
    ctx = RunContext.new(Path(home) if home else None).model_copy(update={"standin": standin.decide(spec)})
    if spec.storage.shared_cache:  # opt-in: steps read through the bucket's shared cache (stoker/cache/)
        ctx = ctx.model_copy(update={"shared_cache": spec.storage})
    started, t0 = time.time(), time.perf_counter()
    steps, error, status = Steps(), None, "completed"
    try:
        run_steps(spec, ctx, steps, force)
    except BaseException as exc:  # cancelled (TerminationSignal, a BaseException) or crashed: a true record either way
        error, status = one_line(exc) or type(exc).__name__, ended(exc)
        raise
    finally:
        source = steps["fetch"].detail if "fetch" in steps else {}
        rollback = read_rollback(ctx)
        manifest = build_manifest(spec, ctx, steps, source, started, time.perf_counter() - t0,
                                  status, error, rollback=rollback,
                                  metrics=steps.metrics, evaluation=steps.evaluation)
        if spec.fleet and (ctx.run_dir / "fleet.json").exists():  # per host: wave, status, digests, times
            manifest["fleet"] = json.loads((ctx.run_dir / "fleet.json").read_text())
        if error:
            emit_failure(spec, ctx, error, rollback, status)
        publish_run(spec, ctx, manifest, s3_ok="upload" in steps and steps["upload"].status == "completed")
    return manifest


def run_steps(spec: Spec, ctx: RunContext, steps: Steps, force: bool = False) -> None:
    """The run's steps in order; what builds, packages, deploys and evaluates is the target's."""
    target, fetched, built, packaged, uploaded = build_steps(spec, ctx, steps, force)
    if spec.fleet:  # each host stages, gates and switches on its own worker, wave by wave (tasks/fleet.py)
        with exclusive(deploy_lock(spec.deploy.name), print, f"another run is deploying {spec.deploy.name!r}"):
            rolled = steps.run("fleet", roll_fleet, spec, fetched, uploaded, ctx)
            steps.run("promote", promote_run, spec, rolled, ctx)  # once, for the whole fleet
        return
    deploy_steps(target, spec, ctx, steps, force, built, packaged, uploaded)


def build_steps(spec: Spec, ctx: RunContext, steps: Steps, force: bool = False, cached_only: str | None = None):
    """preflight → fetch → (eval-data) → build → package → upload; returns (target, fetched, built, packaged,
    uploaded). ``cached_only`` (a fleet host's run): every heavy step must come from the shared cache, named so."""
    target = target_of(spec)  # a parameter Prefect validated without the registry: checked here
    steps.run("preflight", preflight_checks, spec, ctx.standin)
    if spec.fleet:  # every host's engine and worker, before any heavy step
        steps.run("fleet-preflight", fleet_preflight, spec)
    fetched = steps.run("fetch", fetch_weights, spec, ctx)
    refuse_rolled_back(spec, fetched, ctx, force)  # a rolled-back build comes back only when forced
    lora = steps.run("adapters", fetch_adapters, spec, fetched, ctx) if spec.adapters else None  # checked, no heavy step yet
    if spec.evaluation.enabled and target.evaluates:  # a bad evaluation text is refused here, before heavy work
        steps.run("eval-data", evaluation_data, spec, fetched, ctx, lora)
    elif spec.evaluation.enabled:
        get_run_logger().warning(f"evaluate: {target.evaluation_note}")
    # GPU targets decide the rollout once, here (ctx.gpu): build, package, stage and the manifest read it.
    ctx.gpu = target.decide_gpus(steps, spec, fetched, ctx)
    if cached_only:  # built once by the fleet run: a step missing from the shared cache is an error, not a build
        built = target.build(steps, spec, fetched, ctx.model_copy(update={"routed_to": cached_only}))
    elif spec.routing.heavy:  # on the pool that has the resource; its results come back through the shared cache
        routed = route_heavy_steps(spec, fetched, ctx)
        built = target.build(steps, spec, fetched, ctx.model_copy(update={"routed_to": spec.routing.heavy}))
        for name in ("quantize", "build"):
            if name in steps:
                mark_routed(steps[name], routed)
    else:
        with target.heavy_slot(spec, ctx):  # a global concurrency limit per GPU (stoker/orchestration/gpu_slot.py); CPU: no slot
            built = target.build(steps, spec, fetched, ctx)
    packaged = target.package(steps, spec, fetched, built, ctx)
    uploaded = steps.run("upload", upload_repository, spec, packaged, ctx)
    return target, fetched, built, packaged, uploaded


def deploy_steps(target, spec: Spec, ctx: RunContext, steps: Steps, force: bool, built: StepResult,
                 packaged: StepResult, uploaded: StepResult, host: str | None = None) -> StepResult:
    """Under the deployment's lock: stage → gates → switch on spec.deploy's engine, then promote. ``host``: a fleet
    host's run (flows/serve_host.py), under that host's own lock (the fleet run holds the deployment's), and not
    promoted (the fleet run promotes once)."""
    # One run at a time serves a deployment, whoever started it (schedule, webhook, UI): two at once would each
    # reconcile away the other's staged candidate. Heavy steps above overlap freely; the second waits here.
    lock = deploy_lock(spec.deploy.name if host is None else host_lock(spec.deploy.name, host))
    with exclusive(lock, print, f"another run is deploying {spec.deploy.name!r}"):
        refuse_older_run(spec, ctx, force, uploaded.digest)  # older than what serves: refused (record/ordering.py)
        ctx.gpu = target.settle_gpus(steps, spec, ctx)  # the candidate's GPUs, chosen once, from what serves now
        target.record_baseline(steps, spec, ctx)  # GPU targets: a missing bf16 baseline, recorded first
        benchmarked = target.deploy(steps, spec, ctx, built, packaged, uploaded)  # evaluated before promoted
        if host is None:
            steps.run("promote", promote_run, spec, benchmarked, ctx)  # its summary becomes the baseline
    return benchmarked


def publish_run(spec: Spec, ctx: RunContext, manifest: dict, s3_ok: bool) -> None:
    """Manifest to disk first (nothing after it, S3 or Prefect's API, can lose the run's record), then to S3, then
    the report and the Prefect artifacts."""
    logger = get_run_logger()
    path = write_local(ctx, manifest)
    uris = []
    if s3_ok:
        try:
            uris.append(store_manifest(spec, manifest))
        except Exception as exc:  # the local manifest still records the run
            logger.warning(f"manifest not stored in S3: {one_line(exc)}")
    report = markdown(manifest, uris + [path.as_uri()])
    write_atomic(ctx.run_dir / "report.md", report)
    key = f"stoker-{spec.deploy.name}"
    try:
        create_markdown_artifact(report, key=f"{key}-report", description="stoker run report")
        if manifest["benchmark"]["levels"]:
            create_table_artifact(benchmark_rows(manifest), key=f"{key}-benchmark", description="benchmark by level")
        if manifest["endpoint"]:
            create_link_artifact(manifest["endpoint"]["http"], link_text="stable HTTP endpoint",
                                 key=f"{key}-endpoint")
        for uri in uris:
            create_link_artifact(uri, link_text="run manifest (S3)", key=f"{key}-manifest")
    except Exception as exc:  # Prefect's API unreachable: the run's record is on disk (and in S3) already
        logger.warning(f"Prefect artifacts not stored: {one_line(exc)}")
    logger.info(f"manifest: {path}")
