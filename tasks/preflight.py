"""preflight: S3 and Docker answer, image and ports are usable, before any heavy step."""

from __future__ import annotations

import time

from prefect import get_run_logger

from stoker.plan.compose import check_adapters, check_evaluation, check_model
from stoker.plan.preflight import preflight
from stoker.run import StepResult
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
