"""Cache keys: inputs' digests + the spec section + tool versions.

A changed byte anywhere in what a step consumes changes its key. Pure.
"""

from __future__ import annotations

from pathlib import Path

from .digest import file_sha256, json_digest
from .spec import Spec
from .versions import code_digest, pick


def step_key(step: str, *, inputs: dict[str, str], config: dict, versions: dict[str, str]) -> str:
    """Content key of one step run; the first 24 hex chars are plenty to avoid collisions."""
    return json_digest({"step": step, "inputs": inputs, "config": config, "versions": versions})[:24]


# ---- the pipeline's keys; `stoker plan` and the tasks share these ----

DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "data" / "calibration.txt"


def calibration_file(spec: Spec) -> Path:
    return spec.quantization.calibration.text_file or DEFAULT_CALIBRATION


def fetch_key(spec: Spec, source_id: str) -> str:
    """source_id: the resolved commit sha, or the digest of a local folder."""
    m = spec.model
    return step_key("fetch", inputs={"source": source_id},
                    config={"repo_id": m.repo_id, "local": m.local_path is not None, "allow_pickle": m.allow_pickle},
                    versions={"code": code_digest("hub.py")})


def quantize_key(spec: Spec, weights_digest: str) -> str:
    q = spec.quantization
    inputs = {"weights": weights_digest}
    versions = {"code": code_digest("workers/quantize.py")}
    if q.format != "none":
        inputs["calibration"] = file_sha256(calibration_file(spec))
        versions |= pick("nvidia-modelopt", "torch", "transformers")
    return step_key("quantize", inputs=inputs, config=q.model_dump(mode="json", exclude={"calibration": {"text_file"}}),
                    versions=versions)


def build_key(spec: Spec, checkpoint_digest: str) -> str:
    return step_key("build", inputs={"checkpoint": checkpoint_digest}, config={"target": spec.target},
                    versions=pick("torch", "safetensors") | {
                        "code": code_digest("workers/build_reference.py", "runtime/dequant.py")})


def package_key(spec: Spec, build_digest: str) -> str:
    return step_key("package", inputs={"build": build_digest}, config=spec.triton.model_dump(mode="json"),
                    versions=pick("tritonclient") | {
                        "code": code_digest("triton_models", "runtime", "triton_config.py", "triton_repo.py")})
