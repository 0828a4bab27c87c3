"""package: the Triton model repository in TensorRT-LLM's ensemble layout."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from stoker import adapters
from stoker.cache.keys import package_key
from stoker.run import RunContext, StepResult, cached_step
from stoker.spec.schema import Spec
from stoker.triton.repository import assemble, settings_for

from . import step_task


@step_task("package", retries=0)
def package_repository(spec: Spec, built: StepResult, ctx: RunContext, lora: StepResult | None = None) -> StepResult:
    """preprocessing → tensorrt_llm (decoupled) → postprocessing, wired by an ensemble; ``lora``: the fetched
    adapters, laid next to the weights (tensorrt_llm/1/adapters/) for the model to serve per request."""
    log = get_run_logger().info

    def produce(out: Path) -> dict:
        empty = assemble(built.path, out, settings_for(spec.triton))
        detail = {"empty_dirs": empty, "models": ["preprocessing", "tensorrt_llm", "postprocessing", "ensemble"]}
        if lora is not None:
            adapters.place(Path(lora.path), lora.detail["adapters"], out / "tensorrt_llm" / "1")
            detail["adapters"] = {n: d["task_id"] for n, d in lora.detail["adapters"].items()}
        return detail

    key = package_key(spec, built.digest, lora.digest if lora is not None else None)
    return cached_step(ctx, "package", key, produce, log)
