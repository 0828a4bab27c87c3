"""preflight: S3 and Docker answer, image and ports are usable, before any heavy step."""

from __future__ import annotations

import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stoker.plan.compose import check_adapters, check_evaluation, check_model
from stoker.plan.preflight import preflight
from stoker.run import RunContext, StepResult
from stoker.spec.schema import Spec

from . import step_task


# One retry, 2 s later: preflight answers a user waiting at a terminal; an S3 or Docker still down after that is
# reported, not waited out (the heavy steps' own retries cover outages that start later).
@step_task("preflight", retries=1)
def preflight_checks(spec: Spec, standin: bool = False) -> StepResult:
    """Fail in seconds on a model the format/target cannot take, an unreachable S3, a missing daemon or image,
    or a port in use. A step of the manifest like the others: its light reads (Hub, S3, Docker) take real time."""
    t0 = time.perf_counter()
    check_model(spec)
    for note in check_adapters(spec):
        get_run_logger().info(f"preflight: adapter {note}")
    for warning in check_evaluation(spec):
        get_run_logger().warning(warning)
    preflight(spec, get_run_logger().info, standin)
    return StepResult(name="preflight", duration_s=time.perf_counter() - t0)


@task(name="rolled-back-check", cache_policy=NO_CACHE, persist_result=False)
def refuse_rolled_back(spec: Spec, fetched: StepResult, ctx: RunContext, force: bool = False) -> None:
    """Refuse in one line, before any heavy step, a run of the spec at the commit whose build `stoker rollback`
    rolled back (stoker/record/rollbacks.py refusal), unless ``force``. Reads $STOKER_HOME/runs and, from S3, the
    rollback records and the runs since (one listing); S3 unreadable here: the local records decide, one warning."""
    from stoker.errors import StokerError
    from stoker.record import rollbacks
    from stoker.record.history import merge
    from stoker.record.manifest import read_manifests
    from stoker.storage import s3

    logger = get_run_logger()
    name = spec.deploy.name
    local = [m for m in read_manifests(ctx.home) if ((m.get("spec") or {}).get("deploy") or {}).get("name") == name]
    try:
        remote = rollbacks.read_for_check(s3.client(spec.storage), spec.storage, local)
    except StokerError as err:
        logger.warning(f"rollback records in S3 not read, deciding from {ctx.home / 'runs'} alone: {err}")
        remote = []
    every = [m for m in merge(local, remote) if ((m.get("spec") or {}).get("deploy") or {}).get("name") == name]
    sha = fetched.detail.get("sha")
    line = rollbacks.refusal(every, spec.digest(), sha, force)
    if line:
        raise rollbacks.RolledBack(line)
    if force and (was := rollbacks.refusal(every, spec.digest(), sha)):
        logger.warning(f"force: deploying it again although {was.split(': pass force')[0]}")
