"""benchmark: streaming load against the deployed model (the target's interface), with the same library code as
`stoker bench`."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact

from stoker.storage import s3
from stoker.bench.output import PLOT_PNG, markdown_table
from stoker.bench.session import execute, for_adapter, from_spec
from stoker.storage.digest import tree_records
from stoker.cache.keys import benchmark_key, benchmark_settings
from stoker.run import Output, RunContext, StepResult, cached_step
from stoker.spec.adapters import task_id
from stoker.spec.schema import Spec
from stoker import targets

from . import step_task

_TYPES = {".png": "image/png", ".json": "application/json", ".jsonl": "application/x-ndjson", ".csv": "text/csv",
          ".md": "text/markdown"}


@step_task("benchmark", retries=0)
def benchmark_endpoint(spec: Spec, deployed: StepResult, built: StepResult, ctx: RunContext) -> StepResult:
    """Warm up, then each load level; records, summary, table and plot on disk, in S3 and as artifacts.

    The figures are kept per backend (keys.benchmark_key): a rerun whose deploy reused the backend that
    was measured, with the same settings, reuses its figures (benchmark.remeasure measures again)."""
    logger = get_run_logger()
    t0 = time.perf_counter()

    def measure(out: Path) -> dict:
        config, workload = from_spec(spec.benchmark, deployed.detail["grpc"], deployed.detail["http"],
                                     targets.get(spec.target).interface,
                                     built.path / "tokenizer.json")
        result, summary, files = execute(config, workload, out, progress=logger.info,
                                         title=f"{spec.deploy.name}: run {ctx.run_id}",
                                         meta={"run_id": ctx.run_id, "deployment": spec.deploy.name})
        for warning in result.warnings:
            logger.warning(warning)
        # Each LoRA adapter under the same load, selected per request as a client selects it.
        adapters = {}
        for a in spec.adapters:
            logger.info(f"benchmark: adapter {a.name}")
            _, s, _ = execute(for_adapter(config, a.name, task_id(a.name)), workload, out / "adapters" / a.name,
                              progress=logger.info, title=f"{spec.deploy.name}, adapter {a.name}: run {ctx.run_id}",
                              meta={"run_id": ctx.run_id, "deployment": spec.deploy.name, "adapter": a.name})
            adapters[a.name] = s["levels"]
        return {"levels": summary["levels"], "workload": summary["workload"], "warnings": summary["warnings"],
                "s3": _store(spec, ctx, files, logger), "measured_in": ctx.run_id,
                **({"adapters": adapters} if adapters else {})}

    backend = deployed.detail.get("candidate")
    if backend and not spec.benchmark.remeasure:
        kept = cached_step(ctx, "benchmark", benchmark_key(backend, benchmark_settings(spec)), measure, logger.info)
        if kept.cache_hit:
            logger.info(f"benchmark: the figures of run {kept.detail['measured_in']} (this backend, these settings); "
                        "benchmark.remeasure: true measures again")
        out, detail, outputs, hit = kept.path, kept.detail, kept.outputs, kept.cache_hit
    else:  # a backend that is not kept (GPU targets) or a measurement asked for
        out = ctx.run_dir / "benchmark"
        out.mkdir(parents=True, exist_ok=True)
        detail, hit = measure(out), False
        outputs = [Output(uri=(out / r.path).as_uri(), sha256=r.sha256, bytes=r.bytes) for r in tree_records(out)]
    _artifacts(spec, detail, out, hit)
    return StepResult(name="benchmark", duration_s=time.perf_counter() - t0, outputs=outputs, cache_hit=hit,
                      detail=detail)


def _store(spec: Spec, ctx: RunContext, files: list[Path], logger) -> dict[str, str]:
    """The run's record, next to its manifest in S3; local files still hold it when S3 fails."""
    st, uris = spec.storage, {}
    try:
        client = s3.client(st)
        for path in files:
            uris[path.name] = s3.put_file(client, st, s3.run_key(st, ctx.run_id, f"benchmark/{path.name}"), path,
                                          _TYPES.get(path.suffix, "application/octet-stream"))
    except Exception as exc:  # noqa: BLE001 -- say so, do not fail the run
        logger.warning(f"benchmark files not stored in S3: {type(exc).__name__}: {exc}")
    return uris


def _artifacts(spec: Spec, detail: dict, out: Path, reused: bool) -> None:
    key = f"stoker-{spec.deploy.name}"
    plot = detail["s3"].get(PLOT_PNG) or (out / PLOT_PNG).as_uri()
    notes = "".join(f"\n- warning: {w}" for w in detail["warnings"])
    origin = f", reused from run `{detail['measured_in']}` (same backend, same settings)" if reused else ""
    create_markdown_artifact(f"## Benchmark, run `{detail['measured_in']}`{origin}\n\n{markdown_table(detail['levels'])}\n"
                             f"latency–throughput plot: {plot}{notes}\n", key=f"{key}-benchmark-table",
                             description="benchmark by level (GenAI-Perf definitions)")
    create_link_artifact(plot, link_text="latency–throughput plot (PNG)", key=f"{key}-benchmark-plot")
