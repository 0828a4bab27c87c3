"""What each of stoker's targets is, as data: the one place that says which target does what.

Pure, in the core layer, so that every layer reads it: the spec and the cache keys below the services, and
stoker/gpu, which may not import stoker/targets (pyproject.toml's contracts). Code outside the targets asks a
target's traits (``of(spec.target).builds_engine``), never its name; the target classes (stoker/targets/) take
their name, layout and place from here, so nothing is said twice. tests/unit/test_target_names.py keeps it so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Traits:
    name: str
    runs_on: Literal["cpu", "gpu"] = "cpu"  # where its heavy steps and backends run
    layout: str = ""  # the Triton repository layout its package step writes
    # Its build exports a TensorRT-LLM checkpoint (also unquantized: trtllm-build 1.2 reads nothing else) and runs
    # trtllm-build on it; the engine is the artifact. So the whole build section, the GPU's architecture and the LoRA
    # plugin are inputs of the build, and the engine's own limits (batch size, plugins, image) are checked at plan.
    builds_engine: bool = False
    # Serves a Hugging Face checkpoint on TensorRT-LLM's PyTorch backend (the LLM API): the quantized unified
    # checkpoint is what its repository holds, matrix.json's `pytorch_sm` ranges apply, and a started backend warms
    # up (autotuning, CUDA graphs) before it is ready.
    pytorch_backend: bool = False
    # The quantized formats it builds, in stoker's order; None: those matrix.json lists it for.
    formats: tuple[str, ...] | None = None
    # The architectures it serves exactly; None: any its build takes (an engine: stoker/gpu/decoders.py's).
    architectures: tuple[str, ...] | None = None
    # The target whose build and runtime stand in for it under STOKER_STANDIN=1 (stoker/gpu/standin.py); None: none.
    standin: str | None = None


REFERENCE = Traits(
    "reference", "cpu", "ensemble",  # preprocessing → tensorrt_llm (stoker runtime, decoupled) → postprocessing
    # ModelOpt PTQ, dequantized by the build step; the spec's own order, minus none (never a useful alternative).
    formats=("fp8", "int4_awq", "int8_sq", "w4a8_awq"),
    # The reference runtime runs transformers' own model class for config.json's architecture
    # (stoker/runtime/model.py), so biases, sliding windows, rope variants and activations are transformers'.
    # What limits it is the build step: dequantizing every quantized linear by name and finding the exported
    # per-layer K/V scales. These are the architectures served and matched with transformers token for token
    # (tests/integration/test_architectures_served.py: each unquantized, Qwen2 fp8 + fp8 KV for biases beside
    # quantized weights, Phi-3 int4_awq for fused qkv/gate_up; Mistral shares Llama's tensor names); any other
    # would be a guess.
    architectures=("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"))
TENSORRT = Traits("tensorrt", "gpu", "inflight_batcher_llm", builds_engine=True, standin=REFERENCE.name)
PYTORCH = Traits("pytorch", "gpu", "llmapi", pytorch_backend=True, standin=REFERENCE.name)

TRAITS = {t.name: t for t in (REFERENCE, TENSORRT, PYTORCH)}
DEFAULT = REFERENCE.name


def of(name: str | None) -> Traits:
    """The traits of the target called ``name``. A target registered from outside stoker (a test's) has none of
    these: what it does differently is its own class's business."""
    return TRAITS.get(name) or Traits(name or "")
