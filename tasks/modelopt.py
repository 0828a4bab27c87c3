"""quantize: nvidia-modelopt PTQ in a child process, checked structurally."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from prefect import get_run_logger

from stoker.orchestration.child import run_module
from stoker.cache.keys import calibration_file, quantize_key
from stoker.plan.quant_check import check_checkpoint
from stoker.run import RunContext, StepResult, cached_step
from stoker.spec.schema import Spec

from . import step_task


def _link_tree(src: Path, dst: Path) -> None:
    """Pass-through: hard links cost no space and keep the bytes identical."""
    for p in sorted(src.rglob("*")):
        if p.is_file():
            target = dst / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, target)
            except OSError:
                target.write_bytes(p.read_bytes())


@step_task("quantize", retries=1)
def quantize_weights(spec: Spec, fetched: StepResult, ctx: RunContext) -> StepResult:
    """ModelOpt post-training quantization to the unified HF checkpoint ('none' passes weights through)."""
    log = get_run_logger().info
    q = spec.quantization

    def produce(out: Path) -> dict:
        if q.format == "none":
            _link_tree(fetched.path, out)
            return {"format": "none", "passthrough": True}
        cal = q.calibration
        request = {"checkpoint": str(fetched.path), "format": q.format,
                   "kv_cache_dtype": None if q.kv_cache_dtype == "none" else q.kv_cache_dtype,
                   "calibration": {"text_file": str(calibration_file(spec)), "samples": cal.samples,
                                   "seq_len": cal.seq_len, "batch_size": cal.batch_size},
                   "seed": 0}
        with tempfile.TemporaryDirectory() as tmp:
            req = Path(tmp) / "request.json"
            req.write_text(json.dumps(request))
            run_module("stoker.workers.quantize", ["--request", str(req), "--out", str(out)], log)
        report = check_checkpoint(out, q.format, request["kv_cache_dtype"])
        log(f"quantize: structural check passed ({q.format}, kv {q.kv_cache_dtype})")
        info_file = out / "stoker_quantize.json"
        info = json.loads(info_file.read_text()) if info_file.exists() else {}
        return {"format": q.format, "kv_cache_dtype": q.kv_cache_dtype, "check": _jsonable(report), "worker": info}

    return cached_step(ctx, "quantize", quantize_key(spec, fetched.digest), produce, log)


def _jsonable(report) -> dict:
    if hasattr(report, "model_dump"):
        return report.model_dump(mode="json")
    if hasattr(report, "__dataclass_fields__"):
        from dataclasses import asdict

        return json.loads(json.dumps(asdict(report), default=str))
    return {"summary": str(report)}
