"""Cache keys: inputs' digests + the spec section + tool versions.

A changed byte anywhere in what a step consumes changes its key. Pure.
"""

from __future__ import annotations

from pathlib import Path

from .. import target_traits
from ..storage.digest import file_sha256, json_digest
from ..spec.schema import Spec
from ..versions import code_digest, pick


def step_key(step: str, *, inputs: dict[str, str], config: dict, versions: dict[str, str]) -> str:
    """Content key of one step run; the first 24 hex chars are plenty to avoid collisions."""
    return json_digest({"step": step, "inputs": inputs, "config": config, "versions": versions})[:24]


# ---- the pipeline's keys; `stoker plan` and the tasks share these ----

DEFAULT_CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"


def calibration_file(spec: Spec) -> Path:
    return spec.quantization.calibration.text_file or DEFAULT_CALIBRATION


def fetch_key(spec: Spec, source_id: str) -> str:
    """source_id: the resolved commit sha, or the digest of a local folder."""
    m = spec.model
    return step_key("fetch", inputs={"source": source_id},
                    config={"repo_id": m.repo_id, "local": m.local_path is not None, "allow_pickle": m.allow_pickle},
                    versions={"code": code_digest("storage/hub.py")})


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


def adapters_key(spec: Spec, shas: dict[str, str], weights_digest: str) -> str:
    """The adapters at their commits, checked against these base weights and the spec's rank limit."""
    return step_key("adapters", inputs={"adapters": shas, "weights": weights_digest},
                    config={"repos": {a.name: a.repo_id for a in spec.adapters}, "max_rank": spec.lora.max_rank},
                    versions={"code": code_digest("adapters.py", "runtime/lora_config.py", "storage/hub.py")})


def package_key(spec: Spec, build_digest: str, adapters_digest: str | None = None) -> str:
    # The adapters are an input of the package only: a new adapter revision reuses the quantized base and the build.
    inputs = {"build": build_digest} | ({"adapters": adapters_digest} if adapters_digest else {})
    return step_key("package", inputs=inputs, config=spec.triton.model_dump(mode="json"),
                    versions=pick("tritonclient") | {
                        "code": code_digest("triton/models", "runtime", "triton/config.py", "triton/repository.py")})


# ---- GPU targets (tensorrt, pytorch): one key covers all GPU work (quantize + checkpoint + engine) ----

def gpu_build_key(spec: Spec, weights_digest: str, argvs: list[list[str]]) -> str:
    """Weights digest + quant config (+ calibration text) + build config + image digest/TRT-LLM version +
    GPU architecture + ``argvs``, the container steps' commands (stoker.gpu.trtllm.step_argvs): engines are tied to
    all of them. A hit skips every GPU step."""
    from ..gpu import matrix

    q, engine = spec.quantization, target_traits.of(spec.target).builds_engine
    inputs = {"weights": weights_digest}
    if q.format != "none":
        inputs["calibration"] = file_sha256(calibration_file(spec))
    image = matrix.image_info(spec.deploy.image)
    gpu = matrix.gpu_info(spec.gpus.type) if spec.gpus else None
    config = {"target": spec.target, "quantization": q.model_dump(mode="json", exclude={"calibration": {"text_file"}}),
              "parallel": spec.parallel.model_dump(mode="json"),
              # A target that builds no engine (the LLM API) applies its build limits at load time (package key).
              "build": spec.build.model_dump(mode="json", exclude={"image"}) if engine else None,
              # Every argument the container steps run with (the quantize worker reads build.dtype for both
              # targets). Rendered without the model's facts: what they add comes from the weights, keyed above;
              # so is build.dtype `auto` (the weights' dtype), which is why the dtype is keyed as written too.
              "argv": argvs, "dtype": spec.build.dtype}
    if spec.adapters and engine:  # built for adapters (the LoRA plugin), never from them
        config["lora"] = {"max_rank": spec.lora.max_rank}
    versions = {"image": spec.deploy.image_digest or spec.deploy.image, "trtllm": image.trtllm if image else None,
                "gpu_arch": gpu.arch if gpu and engine else None,
                "code": code_digest("gpu/quantize_worker.py", "gpu/checkpoint_check.py", "gpu/trtllm.py")}
    return step_key("gpu-build", inputs=inputs, config=config, versions=versions)


def gpu_package_key(spec: Spec, build_digest: str, adapters_digest: str | None = None) -> str:
    inputs = {"build": build_digest} | ({"adapters": adapters_digest} if adapters_digest else {})
    return step_key("gpu-package", inputs=inputs,
                    config={"target": spec.target, "triton": spec.triton.model_dump(mode="json"),
                            "runtime": spec.runtime.model_dump(mode="json"), "build": spec.build.model_dump(mode="json"),
                            "parallel": spec.parallel.model_dump(mode="json")},
                    # tokenizers: it serializes tokenizer_str of the xgrammar tokenizer info (gpu/tokenizer_info.py).
                    versions=pick("tritonclient", "tokenizers") | {"code": code_digest(
                        "gpu", "triton/models", "triton/config.py", "runtime/lora_trtllm.py", "targets/tensorrt.py",
                        "targets/pytorch.py", "target_traits.py")})


# ---- evaluation: measurements are cached; the verdict (thresholds) is judged again every run ----

def baseline_key(weights_digest: str, evalset_digest: str, tolerance: float, adapters_digest: str | None = None) -> str:
    """The unquantized build of the weights, scored on the evaluation set and checked against transformers:
    everything it depends on is the weights, the data and the build, runtime and metric code (and the adapters
    scored on it, when the spec has some)."""
    inputs = {"weights": weights_digest, "evalset": evalset_digest} | ({"adapters": adapters_digest}
                                                                        if adapters_digest else {})
    return step_key("baseline", inputs=inputs,
                    config={"tolerance": tolerance}, versions=pick("torch", "transformers", "safetensors") | {
                        "code": code_digest("workers/evaluate_baseline.py", "workers/build_reference.py",
                                            "runtime", "evaluation")})


def evaluate_key(served_digest: str, evalset_digest: str, lm_eval: dict | None) -> str:
    """The served repository's scores: the same digest, data and metric code give the same numbers."""
    return step_key("evaluate", inputs={"served": served_digest, "evalset": evalset_digest},
                    config={"lm_eval": lm_eval},
                    versions={"code": code_digest("evaluation")}
                    | ({"lm_eval_code": code_digest("workers/lm_eval_run.py")} | pick("lm-eval") if lm_eval else {}))


def benchmark_settings(spec: Spec) -> dict:
    """What the benchmark step measures with: the spec's load, and each adapter measured under it."""
    return spec.benchmark.model_dump(mode="json") | (
        {"adapters": [a.name for a in spec.adapters]} if spec.adapters else {})


def benchmark_key(backend: dict, benchmark: dict) -> str:
    """One running backend (its container, ports, digest and the run that started it) measured with the same
    load and code gives the same figures: an unchanged rerun reuses them. The gate's thresholds are not
    part of the measurement."""
    return step_key("benchmark", inputs={"backend": json_digest(backend)},
                    config={k: v for k, v in benchmark.items() if k not in ("gate", "remeasure")},
                    versions={"code": code_digest("bench")})
