"""package: the Triton model repository in TensorRT-LLM's ensemble layout."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from stoker.cache.keys import package_key
from stoker.run import RunContext, StepResult, cached_step
from stoker.spec.schema import Spec
from stoker.triton.repository import assemble, settings_for

from . import step_task


@step_task("package", retries=0)
def package_repository(spec: Spec, built: StepResult, ctx: RunContext) -> StepResult:
    """preprocessing → tensorrt_llm (decoupled) → postprocessing, wired by an ensemble."""
    log = get_run_logger().info

    def produce(out: Path) -> dict:
        empty = assemble(built.path, out, settings_for(spec.triton))
        return {"empty_dirs": empty, "models": ["preprocessing", "tensorrt_llm", "postprocessing", "ensemble"]}

    return cached_step(ctx, "package", package_key(spec, built.digest), produce, log)
