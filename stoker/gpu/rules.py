"""Checks `stoker plan` runs for GPU targets before any GPU time: each refusal is one line naming the fix.

Pure: inputs are the spec, the model's facts (stoker.gpu.facts) and whether a Hub
token is at hand. Memory numbers are estimates (documented in `estimate_memory`),
good enough to refuse what cannot fit, not to promise what will.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .. import target_traits
from ..plan import model_checks
from ..errors import PlanRefused
from . import matrix, openai_frontend
from .facts import ModelFacts

GIB = 1 << 30
# CUDA context, cuBLAS/NCCL workspaces and TensorRT's own buffers: a flat per-GPU reserve.
RUNTIME_RESERVE_BYTES = int(1.5 * GIB)


@dataclass(frozen=True)
class Finding:
    level: Literal["refuse", "note"]
    field: str
    message: str

    def line(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class MemoryEstimate:
    weights_per_gpu: int
    activations_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    min_required_per_gpu: int  # weights + activations + reserve + one max_seq_len sequence of KV
    gpu_memory: int
    kv_capacity_tokens: int  # at kv_cache_free_gpu_mem_fraction of what is left

    @property
    def fits(self) -> bool:
        return self.min_required_per_gpu <= self.gpu_memory


def max_seq_len(spec, facts: ModelFacts | None) -> int | None:
    """The engine's max_seq_len: the spec's, else the model's context (trtllm-build's own default)."""
    if spec.build.max_seq_len is not None:
        return spec.build.max_seq_len
    return facts.context if facts else None


def weight_bytes(facts: ModelFacts, fmt: str, dtype_bytes: int = 2) -> int:
    """Quantized body + 16-bit embeddings/lm_head (ModelOpt keeps those unquantized)."""
    bits = matrix.format_info(fmt)["weight_bits"]
    body = facts.params - facts.embedding_params
    body_bytes = body * dtype_bytes if fmt == "none" else int(body * bits / 8)
    return body_bytes + facts.embedding_params * dtype_bytes


def estimate_memory(spec, facts: ModelFacts, gpu: matrix.GpuInfo) -> MemoryEstimate:
    """Per-GPU memory: weights split over TP×PP, activations ≈ max_num_tokens × (hidden + intermediate) × 2 B × 4
    (a few live buffers), KV = 2 (K and V) × layers/PP × kv_heads/TP × head_dim × kv bytes per token."""
    tp, pp = spec.parallel.tensor, spec.parallel.pipeline
    q = spec.quantization
    weights = weight_bytes(facts, q.format) // (tp * pp)
    activations = spec.build.max_num_tokens * (facts.hidden + facts.intermediate) * 2 * 4 // tp
    kv_heads_per_gpu = max(1, facts.kv_heads // tp)
    layers_per_gpu = -(-facts.layers // pp)
    kv_token = 2 * layers_per_gpu * kv_heads_per_gpu * facts.head_dim * matrix.kv_info(q.kv_cache_dtype)["bytes"]
    seq = max_seq_len(spec, facts) or facts.context
    memory = gpu.memory_mib << 20
    required = weights + activations + RUNTIME_RESERVE_BYTES + kv_token * seq
    free = max(0, memory - weights - activations - RUNTIME_RESERVE_BYTES)
    capacity = int(free * spec.runtime.kv_cache_free_gpu_mem_fraction) // kv_token
    return MemoryEstimate(weights, activations, kv_token, required, memory, capacity)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


# Build fields that only trtllm-build reads: a target that builds no engine (the LLM API) takes the lengths and batch
# limits alone.
ENGINE_ONLY_BUILD = frozenset({"opt_num_tokens", "kv_cache_type", "gemm_plugin", "gpt_attention_plugin",
                               "remove_input_padding", "context_fmha", "use_paged_context_fmha", "use_fp8_context_fmha",
                               "multiple_profiles", "gather_context_logits", "workers", "image", "engine_dir"})


def check(spec, facts: ModelFacts | None, token_present: bool) -> list[Finding]:
    """Every finding for a GPU-target spec; `refuse` ones must stop the plan."""
    out: list[Finding] = []

    def refuse(field: str, msg: str) -> None:
        out.append(Finding("refuse", field, msg))

    def note(field: str, msg: str) -> None:
        out.append(Finding("note", field, msg))

    target, q, b = spec.target, spec.quantization, spec.build
    engine = target_traits.of(target).builds_engine
    current = matrix.current_image()
    # -- the serving image ------------------------------------------------------------------
    img = matrix.image_info(spec.deploy.image)
    if img is None:
        refuse("deploy.image", f"{spec.deploy.image} is not in stoker's version matrix; use {current}")
    elif img.trtllm is None:
        refuse("deploy.image", f"{img.ref} carries no TensorRT-LLM (it serves target {', '.join(img.targets)}): "
                               f"target {target} needs NVIDIA's serving image, such as {current}")
    elif engine and not img.trtllm_build:
        refuse("deploy.image", f"{img.ref} carries TRT-LLM {img.trtllm or 'none'}, which has no trtllm-build (the "
                               f"{matrix.data()['engine_backend_last_line']} line was the last): use target: pytorch "
                               f"(the LLM API), or an image of that line such as {current}")
    elif target not in img.targets:
        refuse("deploy.image", f"{img.ref} cannot serve target {target!r}; use {current}")
    elif not img.supported:
        refuse("deploy.image", f"{img.ref} carries TRT-LLM {img.trtllm}, which stoker does not support; "
                               f"use {current} (TRT-LLM {matrix.image_info(current).trtllm})")
    # -- deploy.openai: stoker's OpenAI service, not Triton's frontend (openai_frontend.py says why) --
    # Only for an image that passed the checks above: a refused image needs no second refusal.
    if not any(f.level == "refuse" and f.field == "deploy.image" for f in out):
        for f in openai_frontend.findings(spec):
            (refuse if f.level == "refuse" else note)("deploy.openai", f.message)
    # -- build and serve with one TRT-LLM -----------------------------------------------------
    if engine and img is not None and b.image and b.image != spec.deploy.image:
        built = matrix.image_info(b.image)
        if built is None or built.trtllm != img.trtllm:
            have = f"TRT-LLM {built.trtllm}" if built else "an unknown TRT-LLM"
            refuse("build.image", f"the engine would be built by {have} and served by TRT-LLM {img.trtllm}; "
                                  "drop build.image to build in the serving image")
    if engine and b.engine_dir is not None and img is not None:
        version = engine_version(b.engine_dir)
        if version != img.trtllm:
            refuse("build.engine_dir", f"engine built by TRT-LLM {version or 'unknown'} cannot be served by "
                                       f"TRT-LLM {img.trtllm}; rebuild it (drop build.engine_dir)")
    if not engine and (given := sorted(ENGINE_ONLY_BUILD & b.model_fields_set)):
        refuse("build", f"{', '.join('build.' + f for f in given)}: trtllm-build settings, for the engine target only; "
                        f"remove them for target {target}")
    # -- the GPU can run the format -------------------------------------------------------------
    gpu = matrix.gpu_info(spec.gpus.type)
    fmt, kv = matrix.format_info(q.format), matrix.kv_info(q.kv_cache_dtype)
    if target not in fmt["targets"]:
        refuse("quantization.format", f"{q.format!r} is not served by target {target!r}; use target 'tensorrt' "
                                      f"or one of {', '.join(_formats_for(target))}")
    if target not in kv["targets"]:
        refuse("quantization.kv_cache_dtype", f"{q.kv_cache_dtype!r} cannot be exported in the unified HF "
                                              f"checkpoint target {target!r} loads; use 'fp8' or target 'tensorrt'")
    if gpu is None:
        refuse("gpus.type", f"unknown GPU {spec.gpus.type!r}; known: {', '.join(matrix.gpu_keys())}")
    else:
        runnable = [f for f in _formats_for(target) if _runs(f, target, gpu.sm)]
        lo, hi = _sm_range(q.format, target)
        if not _runs(q.format, target, gpu.sm):
            where = (f"needs compute capability >= {_cc(lo)}" if hi is None else
                     f"runs on compute capability {_cc(lo)}–{_cc(hi)} only")
            backend = " on the PyTorch backend" if target_traits.of(target).pytorch_backend else ""
            refuse("quantization.format", f"{q.format!r}{backend} {where}; the {gpu.name} has {_cc(gpu.sm)}: use one "
                                          f"of {', '.join(runnable)}" + (" or a newer GPU" if gpu.sm < lo else ""))
        if kv["min_sm"] > gpu.sm:
            refuse("quantization.kv_cache_dtype", f"{q.kv_cache_dtype!r} KV cache needs compute capability >= "
                                                  f"{_cc(kv['min_sm'])}; the {gpu.name} has {_cc(gpu.sm)}: use 'int8' "
                                                  "or 'none'")
        for flag, value, need in (("gemm_plugin", b.gemm_plugin, {"fp8": 89, "nvfp4": 100}.get(b.gemm_plugin)),
                                  ("use_fp8_context_fmha", b.use_fp8_context_fmha, 89 if b.use_fp8_context_fmha else None)):
            if engine and need and need > gpu.sm:
                refuse(f"build.{flag}", f"{value} needs compute capability >= {_cc(need)}; the {gpu.name} has "
                                        f"{_cc(gpu.sm)}: use the default")
    if engine and b.use_fp8_context_fmha and q.format not in ("fp8", "fp8_pc_pt", "nvfp4", "w4a8_awq"):
        refuse("build.use_fp8_context_fmha", "needs an FP8 quantization format; set quantization.format: fp8")
    # -- GPUs and parallelism ---------------------------------------------------------------------
    world = spec.parallel.world_size
    if world > spec.gpus.count:
        refuse("parallel", f"tensor x pipeline = {world} needs {world} GPUs but gpus.count is {spec.gpus.count}; "
                           f"raise gpus.count or lower parallel.tensor/pipeline")
    elif world < spec.gpus.count:
        note("gpus.count", f"{spec.gpus.count - world} of {spec.gpus.count} GPUs stay unused (tensor x pipeline = "
                           f"{world})")
    # -- the model itself: block sizes, KV heads over TP, architectures (stoker/plan/model_checks.py) ----
    for field, message in model_checks.refusals(spec, facts, gpu.sm if gpu else None):
        refuse(field, message)
    if facts is not None:
        if facts.heads % spec.parallel.tensor:
            refuse("parallel.tensor", f"{spec.parallel.tensor} does not divide the model's {facts.heads} attention "
                                      "heads; use a divisor")
        if spec.parallel.pipeline > facts.layers:
            refuse("parallel.pipeline", f"{spec.parallel.pipeline} exceeds the model's {facts.layers} layers")
    # -- lengths ------------------------------------------------------------------------------------
    seq = max_seq_len(spec, facts)
    if facts is not None and seq is not None and seq > facts.context and not b.allow_long_context:
        refuse("build.max_seq_len", f"{seq} exceeds the model's context of {facts.context} tokens; lower it or "
                                    "opt in with build.allow_long_context: true")
    if seq is not None and b.max_input_len >= seq:
        refuse("build.max_input_len", f"{b.max_input_len} leaves no room for output within max_seq_len {seq}; "
                                      "lower max_input_len or raise max_seq_len")
    if seq is not None and spec.benchmark.input_tokens + spec.benchmark.output_tokens > seq:
        refuse("benchmark", f"input_tokens + output_tokens = {spec.benchmark.input_tokens + spec.benchmark.output_tokens}"
                            f" exceeds max_seq_len {seq}; shorten the benchmark or raise build.max_seq_len")
    if spec.benchmark.input_tokens > b.max_input_len:
        refuse("benchmark.input_tokens", f"{spec.benchmark.input_tokens} exceeds build.max_input_len "
                                         f"{b.max_input_len}; raise max_input_len")
    if engine and spec.triton.max_batch_size > b.max_batch_size:
        refuse("triton.max_batch_size", f"{spec.triton.max_batch_size} exceeds the engine's build.max_batch_size "
                                        f"{b.max_batch_size}; lower it or raise build.max_batch_size")
    if b.max_input_len > b.max_num_tokens and not spec.runtime.enable_chunked_context:
        note("build.max_num_tokens", f"{b.max_num_tokens} < max_input_len {b.max_input_len}: long prompts need "
                                     "runtime.enable_chunked_context: true")
    # -- access --------------------------------------------------------------------------------------
    if facts is not None and facts.gated and not token_present:
        m = spec.model
        where = f"Prefect Secret {m.token_secret!r}" if m.token_secret else f"${m.token_env}"
        refuse("model.repo_id", f"{m.repo_id} is gated and no Hub token is set: put a token with access in {where}")
    if facts is None:
        note("model", "model facts unknown (Hub unreachable, repo not in stoker/gpu/known_models.json): "
                      "context, memory and gating unchecked")
    # -- memory ----------------------------------------------------------------------------------------
    if facts is not None and gpu is not None and spec.build.engine_dir is None:
        est = estimate_memory(spec, facts, gpu)
        if not est.fits:
            refuse("gpus.type", f"~{_gib(est.min_required_per_gpu)} per GPU needed (weights {_gib(est.weights_per_gpu)}"
                                f" + activations + one {seq}-token sequence of KV) but the {gpu.name} has "
                                f"{_gib(est.gpu_memory)}: quantize (e.g. int4_awq), add GPUs (parallel.tensor) or "
                                "lower build.max_seq_len/max_num_tokens")
        else:
            fit = est.kv_capacity_tokens // max(1, seq or 1)
            note("memory", f"~{_gib(est.weights_per_gpu)} weights per GPU; KV cache ~{est.kv_capacity_tokens} tokens "
                           f"(~{fit} full {seq}-token sequences) at fraction {spec.runtime.kv_cache_free_gpu_mem_fraction}")
    return out


def enforce(findings: list[Finding]) -> list[Finding]:
    """Raise PlanRefused on the first refusal; return the notes."""
    for f in findings:
        if f.level == "refuse":
            more = sum(1 for g in findings if g.level == "refuse") - 1
            raise PlanRefused(f.line() + (f" (+{more} more)" if more else ""))
    return findings


def engine_version(engine_dir: Path) -> str | None:
    """TRT-LLM version recorded in an engine folder's config.json ('version'), None if unreadable."""
    try:
        return str(json.loads((Path(engine_dir) / "config.json").read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def _sm_range(fmt: str, target: str) -> tuple[int, int | None]:
    """The compute capabilities on which ``target`` runs ``fmt``: (lowest, highest or None)."""
    info = matrix.format_info(fmt)
    if target_traits.of(target).pytorch_backend and "pytorch_sm" in info:
        lo, hi = info["pytorch_sm"]
        return int(lo), None if hi is None else int(hi)
    return int(info["min_sm"]), None


def _runs(fmt: str, target: str, sm: int) -> bool:
    lo, hi = _sm_range(fmt, target)
    return lo <= sm and (hi is None or sm <= hi)


def _formats_for(target: str) -> list[str]:
    return [k for k, v in matrix.data()["formats"].items() if target in v["targets"]]


def _cc(sm: int) -> str:
    return f"{sm // 10}.{sm % 10}"
