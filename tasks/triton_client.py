"""benchmark: streaming load against the deployed ensemble, with the same library code as `stoker bench`."""

from __future__ import annotations

import time

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from stoker import s3
from stoker.bench.output import PLOT_PNG, markdown_table
from stoker.bench.session import execute, from_spec
from stoker.digest import tree_records
from stoker.run import Output, RunContext, StepResult
from stoker.spec import Spec
from stoker.triton_config import ENSEMBLE_NAME

from . import step_task

_TYPES = {".png": "image/png", ".json": "application/json", ".jsonl": "application/x-ndjson", ".csv": "text/csv",
          ".md": "text/markdown"}


@step_task("benchmark", retries=0)
def benchmark_endpoint(spec: Spec, deployed: StepResult, built: StepResult, ctx: RunContext) -> StepResult:
    """Warm up, then each load level; records, summary, table and plot on disk, in S3 and as artifacts."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    config, workload = from_spec(spec.benchmark, deployed.detail["grpc"], deployed.detail["http"], ENSEMBLE_NAME,
                                 built.path / "tokenizer.json")
    out = ctx.run_dir / "benchmark"
    result, summary, files = execute(config, workload, out, progress=logger.info,
                                     title=f"{spec.deploy.name}: run {ctx.run_id}",
                                     meta={"run_id": ctx.run_id, "deployment": spec.deploy.name})
    for warning in result.warnings:
        logger.warning(warning)
    st, uris = spec.storage, {}
    try:  # the run's record: next to its manifest in S3
        client = s3.client(st)
        for path in files:
            uris[path.name] = s3.put_file(client, st, s3.run_key(st, ctx.run_id, f"benchmark/{path.name}"), path,
                                          _TYPES.get(path.suffix, "application/octet-stream"))
    except Exception as exc:  # noqa: BLE001 -- local files still hold the results; say so, do not fail the run
        logger.warning(f"benchmark files not stored in S3: {type(exc).__name__}: {exc}")
    key = f"stoker-{spec.deploy.name}"
    plot = uris.get(PLOT_PNG) or (out / PLOT_PNG).as_uri()
    notes = "".join(f"\n- warning: {w}" for w in result.warnings)
    create_markdown_artifact(f"## Benchmark, run `{ctx.run_id}`\n\n{markdown_table(summary['levels'])}\n"
                             f"latency–throughput plot: {plot}{notes}\n", key=f"{key}-benchmark-table",
                             description="benchmark by level (GenAI-Perf definitions)")
    create_link_artifact(plot, link_text="latency–throughput plot (PNG)", key=f"{key}-benchmark-plot")
    outputs = [Output(uri=(out / r.path).as_uri(), sha256=r.sha256, bytes=r.bytes) for r in tree_records(out)]
    return StepResult(name="benchmark", duration_s=time.perf_counter() - t0, outputs=outputs,
                      detail={"levels": summary["levels"], "workload": summary["workload"],
                              "warnings": summary["warnings"], "s3": uris})
