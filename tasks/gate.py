"""gate and promote: judge the benchmark against the deployment's promoted baseline (S3), then promote."""

from __future__ import annotations

import time

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from stoker.storage import s3
from stoker.bench.errors import GateFailed
from stoker.bench.gate import Thresholds, evaluate
from stoker.atomic import write_atomic
from stoker.run import RunContext, StepResult
from stoker.spec.schema import Spec

from . import step_task


@step_task("gate", retries=0)
def gate_benchmark(spec: Spec, benchmarked: StepResult, ctx: RunContext) -> StepResult:
    """Fail the run, with a table of what regressed, when the benchmark is worse than the baseline allows."""
    t0 = time.perf_counter()
    g = spec.benchmark.gate
    if not g.enabled:
        return StepResult(name="gate", duration_s=time.perf_counter() - t0, detail={"enabled": False})
    st = spec.storage
    baseline = s3.get_json(s3.client(st), st, s3.baseline_key(st, spec.deploy.name))
    thresholds = Thresholds(output_tokens_per_s_drop_pct=g.output_tokens_per_s_drop_pct,
                            ttft_p99_rise_pct=g.ttft_p99_rise_pct, itl_p99_rise_pct=g.itl_p99_rise_pct,
                            e2e_p99_rise_pct=g.e2e_p99_rise_pct, max_error_rate_pct=g.max_error_rate_pct)
    report = evaluate(benchmarked.detail, baseline, thresholds)
    table = report.table()
    write_atomic(ctx.run_dir / "benchmark" / "gate.md", table)
    create_markdown_artifact(table, key=f"stoker-{spec.deploy.name}-gate", description="regression gate")
    get_run_logger().info(f"gate {'passed' if report.passed else 'FAILED'} against baseline "
                          f"{report.baseline_run_id or '(none)'}: {len(report.regressions)} regressions")
    try:
        report.raise_if_failed()
    except GateFailed as exc:
        get_run_logger().error(f"{exc}\n{exc.table}")
        raise
    return StepResult(name="gate", duration_s=time.perf_counter() - t0, detail=report.to_dict())


@step_task("promote")
def promote_run(spec: Spec, benchmarked: StepResult, ctx: RunContext) -> StepResult:
    """This run's benchmark summary becomes the deployment's baseline (only called once everything passed)."""
    t0 = time.perf_counter()
    st = spec.storage
    baseline = {"run_id": ctx.run_id, "deployment": spec.deploy.name, "spec_digest": spec.digest(),
                "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "workload": benchmarked.detail.get("workload"), "levels": benchmarked.detail.get("levels", [])}
    uri = s3.put_json(s3.client(st), st, s3.baseline_key(st, spec.deploy.name), baseline)
    get_run_logger().info(f"promoted run {ctx.run_id}: baseline {uri}")
    return StepResult(name="promote", duration_s=time.perf_counter() - t0, detail={"baseline": uri})
