"""Plan-time checks of a model's shapes and architecture against the spec's format and target.

Pure: config.json's numbers (stoker.gpu.facts.ModelFacts) in, one-line refusals out, each naming
the model dimension or architecture and what would work. All of it is knowable before download or
calibration; without it, int4_awq on a hidden size of 192 runs the whole calibration and only then
fails at export ("Weight shape 192 … not divisible for block size 128").
"""

from __future__ import annotations

from .. import target_traits
from ..errors import PlanRefused
from ..gpu import decoders, matrix
from ..gpu.facts import ModelFacts

# Formats that quantize weights in blocks along each linear's input dimension (stoker's ModelOpt
# configs: INT4_AWQ_CFG and W4A8_AWQ_BETA_CFG block 128, our int4_wo 128, NVFP4 16).
BLOCK_SIZES = {"int4_awq": 128, "w4a8_awq": 128, "int4_wo": 128, "nvfp4": 16}
BLOCK_KIND = {"int4_awq": "AWQ", "w4a8_awq": "AWQ", "int4_wo": "INT4", "nvfp4": "NVFP4"}
# The engine target exports every format (none included) with ModelOpt's export_tensorrt_llm_checkpoint, under
# the decoder type TensorRT-LLM's own quantization example gives the architecture (stoker/gpu/decoders.py).
# Which formats and architectures the reference runtime takes: stoker/target_traits.py.


def linear_inputs(facts: ModelFacts) -> dict[str, int]:
    """Input dimension of every quantized linear of a Llama-style decoder (lm_head stays 16-bit)."""
    return {
        "hidden_size": facts.hidden,  # q/k/v, gate and up projections
        "num_attention_heads x head_dim": facts.heads * facts.head_dim,  # o_proj
        "intermediate_size": facts.intermediate,  # down_proj
    }


def _fits(fmt: str, facts: ModelFacts) -> bool:
    block = BLOCK_SIZES.get(fmt)
    return block is None or all(dim % block == 0 for dim in linear_inputs(facts).values())


def formats_for(target: str, gpu_sm: int | None = None) -> list[str]:
    """Quantized formats the target can serve (and the GPU run, when known), in stoker's order."""
    own = target_traits.of(target).formats
    if own is not None:
        return list(own)
    return [f for f, info in matrix.data()["formats"].items()
            if f != "none" and target in info["targets"] and (gpu_sm is None or info["min_sm"] <= gpu_sm)]


def block_refusal(fmt: str, facts: ModelFacts, target: str, gpu_sm: int | None = None) -> tuple[str, str] | None:
    """(field, message) when a linear's input dimension is not a multiple of the format's block size."""
    block = BLOCK_SIZES.get(fmt)
    if block is None:
        return None
    bad = next(((name, dim) for name, dim in linear_inputs(facts).items() if dim % block), None)
    if bad is None:
        return None
    working = [f for f in formats_for(target, gpu_sm) if _fits(f, facts)]
    fix = f"use {' or '.join(working[:2])}" if working else "use format none"
    return (f"quantization.format {fmt}",
            f"{bad[0]} {bad[1]} is not a multiple of the {BLOCK_KIND[fmt]} block size {block}; {fix}")


def architecture_refusal(target: str, facts: ModelFacts) -> tuple[str, str] | None:
    """(field, message) when the target cannot build or serve this architecture exactly."""
    arch, traits = facts.architecture, target_traits.of(target)
    if arch == "?":  # config.json names none; not ours to guess
        return None
    if traits.architectures is not None and arch not in traits.architectures:
        return (f"target {target}", f"architecture {arch} is not served by the {target} runtime "
                                    f"({', '.join(traits.architectures)}); use target: pytorch on a GPU host")
    if traits.builds_engine and decoders.decoder_type(arch) is None:
        return (f"target {target}", decoders.refusal(arch))
    return None


def kv_heads_refusal(tensor: int, facts: ModelFacts) -> tuple[str, str] | None:
    """TRT-LLM splits KV heads over TP ranks, or replicates them when TP is a multiple of their count."""
    if tensor <= 1 or facts.kv_heads % tensor == 0 or tensor % facts.kv_heads == 0:
        return None
    divisors = [d for d in range(1, facts.kv_heads + 1) if facts.kv_heads % d == 0 and facts.heads % d == 0]
    return ("parallel.tensor", f"{tensor} neither divides the model's {facts.kv_heads} KV heads nor is a multiple "
                               f"of them; use one of {', '.join(map(str, divisors))}")


def refusals(spec, facts: ModelFacts | None, gpu_sm: int | None = None) -> list[tuple[str, str]]:
    """Every model-level refusal for the spec, as (field, message); none without facts."""
    if facts is None:
        return []
    out = [architecture_refusal(spec.target, facts), block_refusal(spec.quantization.format, facts, spec.target, gpu_sm)]
    if target_traits.of(spec.target).runs_on == "gpu":  # TensorRT-LLM's ranks; the CPU runtime runs in one
        out.append(kv_heads_refusal(spec.parallel.tensor, facts))
    return [r for r in out if r is not None]


def enforce(spec, facts: ModelFacts | None) -> None:
    """Raise PlanRefused (one line) on the first model-level refusal."""
    found = refusals(spec, facts)
    if found:
        field, message = found[0]
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise PlanRefused(f"{field}: {message}{more}")
