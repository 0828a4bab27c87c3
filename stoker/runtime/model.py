"""Load a reference artifact into transformers' own model class for its architecture.

The artifact (written by stoker/workers/build_reference.py) is an HF checkpoint in float32:
model.safetensors with the checkpoint's own tensor names, dequantized with its own scales,
config.json without quantization_config, and stoker_runtime.json (token ids, and the KV-cache
quantization to imitate). Serving it through transformers instead of a model of our own means
every architecture transformers implements is computed with its exact semantics (Qwen2's q/k/v
biases, Mistral's sliding window, rope variants), and the only code of ours on the hot path is the
KV-cache rounding and the decoding loop.

Imports are relative only, so the package also works when copied next to a Triton model.py as
`stoker_runtime`. One sequence at a time (batch 1); each request owns its cache.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .kvquant import KV_CACHE_DTYPES, FakeQuantCache

ARTIFACT_FORMAT = "stoker-reference/1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
RUNTIME_FILE = "stoker_runtime.json"
DEFAULT_NUM_THREADS = 2
QUANT_FORMATS = ("none", "fp8", "int4_awq", "int8_sq", "w4a8_awq")


class ArtifactError(ValueError):
    """The reference artifact is missing, malformed or does not fit its architecture."""


@dataclass(frozen=True)
class RuntimeInfo:
    """stoker_runtime.json: token ids and the quantization the reference must imitate."""

    end_id: int
    pad_id: int
    quant_format: str = "none"
    kv_cache_dtype: str | None = None
    # layer index -> (k scale, v scale)
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)


def runtime_info_from_dict(raw: dict[str, Any], num_layers: int) -> RuntimeInfo:
    """Validate stoker_runtime.json; every layer needs K/V scales when the KV cache is quantized."""
    if raw.get("format") != ARTIFACT_FORMAT:
        raise ArtifactError(f"{RUNTIME_FILE}: format {raw.get('format')!r}, expected {ARTIFACT_FORMAT!r}")
    if raw.get("dtype", "float32") != "float32":
        raise ArtifactError(f"{RUNTIME_FILE}: dtype {raw.get('dtype')!r}, expected 'float32'")
    quant = raw.get("quantization") or {}
    quant_format = quant.get("format", "none")
    if quant_format not in QUANT_FORMATS:
        raise ArtifactError(f"{RUNTIME_FILE}: unknown quantization format {quant_format!r}")
    kv_dtype = quant.get("kv_cache_dtype")
    scales: dict[int, tuple[float, float]] = {}
    if kv_dtype is not None:
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ArtifactError(f"{RUNTIME_FILE}: kv_cache_dtype {kv_dtype!r} not in {KV_CACHE_DTYPES}")
        raw_scales = quant.get("kv_scales") or {}
        for layer in range(num_layers):
            entry = raw_scales.get(str(layer))
            if not entry or "k" not in entry or "v" not in entry:
                raise ArtifactError(f"{RUNTIME_FILE}: kv_cache_dtype {kv_dtype} needs kv_scales for layer {layer}")
            k, v = float(entry["k"]), float(entry["v"])
            if not (k > 0 and v > 0 and math.isfinite(k) and math.isfinite(v)):
                raise ArtifactError(f"{RUNTIME_FILE}: layer {layer} kv scales must be positive, got {entry}")
            scales[layer] = (k, v)
    try:
        return RuntimeInfo(end_id=int(raw["end_id"]), pad_id=int(raw["pad_id"]), quant_format=quant_format,
                           kv_cache_dtype=kv_dtype, kv_scales=scales)
    except KeyError as exc:
        raise ArtifactError(f"{RUNTIME_FILE}: missing key {exc.args[0]!r}") from None


class ReferenceModel:
    """A transformers causal LM plus the artifact's runtime info; thread-safe as long as caches are not shared."""

    def __init__(self, hf_model: Any, info: RuntimeInfo) -> None:
        self.hf = hf_model
        self.info = info
        text = hf_model.config.get_text_config(decoder=True)
        self.vocab_size = int(text.vocab_size)
        self.max_positions = int(text.max_position_embeddings)
        self.num_layers = int(text.num_hidden_layers)

    @property
    def architecture(self) -> str:
        return type(self.hf).__name__

    def new_cache(self) -> Any:
        """An empty cache for one request; it rounds K/V through the KV-cache dtype when the build has one."""
        return FakeQuantCache(self.hf.config, self.info.kv_cache_dtype, self.info.kv_scales)

    @torch.inference_mode()
    def forward(self, tokens: Any, cache: Any) -> torch.Tensor:
        """Run `tokens` (the next positions of the sequence) through the model; their logits [T, vocab].

        Positions come from the cache's length, as in transformers' own generate loop.
        """
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("forward needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token id outside 0..{self.vocab_size - 1}")
        out = self.hf(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"reference artifact lacks {path.name} ({path})") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{path}: invalid JSON ({exc})") from None


def configure_threads(num_threads: int | None) -> None:
    """Cap torch's intra-op threads (process-wide): the CPU is shared with Triton and clients."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)


def _load_hf(root: Path) -> Any:
    """transformers' class for config.json's architecture with our weights, refusing any weight mismatch.

    from_pretrained (not from_config + load_state_dict) because it ties embeddings, keeps
    non-persistent buffers (rotary frequencies) and reports what did not fit; a missing or
    misnamed tensor would otherwise stay randomly initialised and serve nonsense silently.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load would fill Triton's log
    try:
        model, report = AutoModelForCausalLM.from_pretrained(
            str(root), dtype=torch.float32, output_loading_info=True, local_files_only=True)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()
        raise ArtifactError(f"transformers cannot load {root}: {first[0] if first else type(exc).__name__}") from None
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors"):
        found = sorted(str(k) for k in report.get(kind) or ())
        if found:
            raise ArtifactError(f"{WEIGHTS_FILE}: {kind.replace('_', ' ')} for {type(model).__name__}: "
                                f"{', '.join(found[:3])}{' …' if len(found) > 3 else ''}")
    return model.eval()


def load_model(artifact_dir: str | os.PathLike[str], num_threads: int | None = DEFAULT_NUM_THREADS) -> ReferenceModel:
    """Load a reference artifact directory; raises ArtifactError naming what is wrong.

    Sets torch's process-wide thread count to `num_threads` (None leaves it alone).
    """
    root = Path(artifact_dir)
    config = _read_json(root / CONFIG_FILE)
    if not (root / WEIGHTS_FILE).is_file():
        raise ArtifactError(f"reference artifact lacks {WEIGHTS_FILE} ({root})")
    layers = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
    if not isinstance(layers, int):
        raise ArtifactError(f"{CONFIG_FILE}: missing key 'num_hidden_layers'")
    info = runtime_info_from_dict(_read_json(root / RUNTIME_FILE), layers)
    configure_threads(num_threads)
    return ReferenceModel(_load_hf(root), info)
