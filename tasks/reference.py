"""build (reference target): the artifact our CPU runtime serves, made in a child process."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import get_run_logger

from stoker.orchestration.child import run_module
from stoker.cache.keys import build_key
from stoker.run import RunContext, StepResult, cached_step
from stoker.spec.schema import Spec

from . import step_task


@step_task("build", retries=1)
def build_reference(spec: Spec, quantized: StepResult, ctx: RunContext) -> StepResult:
    """Dequantize with the checkpoint's own scales into float32 weights + tokenizer + runtime config."""
    log = get_run_logger().info

    def produce(out: Path) -> dict:
        run_module("stoker.workers.build_reference", ["--checkpoint", str(quantized.path), "--out", str(out)], log)
        runtime = json.loads((out / "stoker_runtime.json").read_text())
        return {"target": spec.target, "end_id": runtime["end_id"],
                "stop_ids": runtime.get("stop_ids", []), "pad_id": runtime["pad_id"],
                "quantization": runtime.get("quantization", {}).get("format")}

    return cached_step(ctx, "build", build_key(spec, quantized.digest), produce, log)
