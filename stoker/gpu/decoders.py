"""Which ModelOpt *decoder type* the legacy TensorRT-LLM checkpoint export gets for a Hugging Face architecture.

ModelOpt's `export_tensorrt_llm_checkpoint` names decoders its own way, not by config.json's model_type: with
decoder_type = model_type it refused qwen2 and mistral (measured on an H100, ModelOpt 0.47), while TensorRT-LLM's
own quantization example passes Qwen2 as `qwen` and Mistral as `llama`, and with those names both exported (fp8,
int4_awq). We map the same way: a lowercase substring of the architecture's class name, first match wins (so the
more specific names come first). Phi-3 has no right name: the exporter refuses it as phi3 or phi, and as llama or
gpt writes a malformed checkpoint (its fused gate_up kept as one `fc`, no `gate`, intermediate_size doubled;
measured, benchmarks/results/engine_architectures.json); its place is the pytorch target (the unified HF
checkpoint). Pure: used at plan time and by the quantize worker on the GPU host.
"""

from __future__ import annotations

# (substring of the architecture class name, lowercase) → decoder type; None: known and refused.
_DECODERS: tuple[tuple[str, str | None], ...] = (
    ("gemma2", None), ("gemma3", None), ("gemma", "gemma"),
    ("qwen2moe", None), ("qwen3", None), ("qwen", "qwen"),
    ("mixtral", "llama"), ("mistral", "llama"), ("llama", "llama"),
    ("mpt", "mpt"), ("dbrx", "dbrx"),
    ("phi3", None),
)
MAPPED = "Llama, Mistral, Mixtral → llama; Qwen2 → qwen; Gemma → gemma; MPT; DBRX"


def decoder_type(architecture: str) -> str | None:
    """ModelOpt's decoder type for the architecture, or None when its legacy export cannot take it."""
    name = architecture.lower()
    return next((dec for key, dec in _DECODERS if key in name), None)


def refusal(architecture: str) -> str:
    """One line: why the engine path cannot take this architecture, and what can."""
    if "phi3" in architecture.lower():
        return (f"architecture {architecture} cannot be exported to a TensorRT-LLM checkpoint: ModelOpt 0.47's "
                "legacy exporter refuses Phi-3 as phi3/phi and writes a malformed one as llama/gpt; use target: "
                "pytorch (the unified HF checkpoint)")
    return (f"architecture {architecture} has no decoder in ModelOpt's legacy TensorRT-LLM export ({MAPPED}); "
            "use target: pytorch")
