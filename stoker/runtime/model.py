"""Load a reference artifact into transformers' own model class for its architecture.

The artifact (written by stoker/workers/build_reference.py) is an HF checkpoint in float32:
model.safetensors with the checkpoint's own tensor names, dequantized with its own scales,
config.json without quantization_config, and stoker_runtime.json (token ids, and the KV-cache
quantization to imitate). Serving it through transformers instead of a model of our own means
every architecture transformers implements is computed with its exact semantics (Qwen2's q/k/v
biases, Mistral's sliding window, rope variants), and the only code of ours on the hot path is the
KV-cache rounding and the decoding loop.

Imports are relative only, so the package also works when copied next to a Triton model.py as
`stoker_runtime`. Each sequence owns its cache. `forward` runs one sequence; `forward_batch` runs
the next token of several sequences in one pass of the model (stoker_runtime.batch schedules them):
every layer's linear algebra is batched, and attention runs per sequence over its own cache, with
transformers' own sdpa function and nothing padded, as that sequence alone would run it.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .kvquant import KV_CACHE_DTYPES, FakeQuantCache
from .lora import Adapters, load_adapters, load_trtllm_adapters, rows_active

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


# Per-sequence attention for forward_batch, registered with transformers' attention (and mask) interfaces
# under this name. Outside forward_batch it is transformers' sdpa, unchanged.
RAGGED_ATTENTION = "stoker_ragged_sdpa"
_ragged = threading.local()  # .rows: layer index -> [(keys, values) of each sequence], during forward_batch


def _ragged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = getattr(_ragged, "rows", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # One query per sequence, over that sequence's whole visible cache (a sliding-window layer returns just its
    # window): the mask of a lone decode step allows every key, so none is passed, as transformers passes none.
    out = [sdpa_attention_forward(module, query[b:b + 1], k, v, None, **kwargs)[0]
           for b, (k, v) in enumerate(rows[module.layer_idx])]
    return torch.cat(out, dim=0), None


def _register_ragged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(RAGGED_ATTENTION, _ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTENTION, sdpa_mask)


class _RaggedCache:
    """The cache transformers sees in forward_batch: each row's K/V goes to that sequence's own cache."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.rows[layer_idx] = [cache.update(key_states[b:b + 1], value_states[b:b + 1], layer_idx, *args, **kwargs)
                                for b, cache in enumerate(self.caches)]
        return key_states, value_states


class ReferenceModel:
    """A transformers causal LM plus the artifact's runtime info; thread-safe as long as caches are not shared."""

    def __init__(self, hf_model: Any, info: RuntimeInfo) -> None:
        self.hf = hf_model
        self.info = info
        text = hf_model.config.get_text_config(decoder=True)
        self.vocab_size = int(text.vocab_size)
        self.max_positions = int(text.max_position_embeddings)
        self.num_layers = int(text.num_hidden_layers)
        rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
        self.rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        self.rope_original_max = rope.get("original_max_position_embeddings",
                                          getattr(text, "original_max_position_embeddings", None))
        self._batching = False
        self.lora = Adapters()  # none until load_model(adapters=…)

    @property
    def architecture(self) -> str:
        return type(self.hf).__name__

    def new_cache(self, adapter: str | None = None) -> Any:
        """An empty cache for one request; it rounds K/V through the KV-cache dtype when the build has one.
        ``adapter``: the LoRA adapter every forward of this sequence applies (None: the base); ValueError for
        one this model does not serve."""
        cache = FakeQuantCache(self.hf.config, self.info.kv_cache_dtype, self.info.kv_scales)
        cache.adapter = self.lora.resolve(adapter)
        return cache

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
        with rows_active([getattr(cache, "adapter", None)]):
            out = self.hf(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0].float()

    def enable_batching(self) -> bool:
        """Route attention through the per-sequence function (sdpa as before, outside forward_batch).

        False (and nothing changed) for a model whose attention is not sdpa or cannot be swapped: its
        sequences then take their decode steps one after another.
        """
        if not self._batching and self.hf.config._attn_implementation == "sdpa":
            _register_ragged_attention()
            self.hf.set_attn_implementation(RAGGED_ATTENTION)
            self._batching = self.hf.config._attn_implementation == RAGGED_ATTENTION
        return self._batching

    def _rope_group(self, position: int) -> Any:
        """Sequences whose rotary frequencies are the same in one pass (they depend on the longest in a pass)."""
        if self.rope_type == "longrope" and self.rope_original_max is not None:
            return position + 1 > int(self.rope_original_max)
        if self.rope_type.startswith("dynamic") or self.rope_type not in ("default", "linear", "llama3", "yarn"):
            return position  # frequencies follow the length itself: only equal lengths share a pass
        return None

    @torch.inference_mode()
    def forward_batch(self, tokens: list[int], caches: list[Any]) -> torch.Tensor:
        """The next token of each sequence (`tokens[i]` extends the sequence of `caches[i]`); logits [B, vocab].

        Equal to `forward([tokens[i]], caches[i])[-1]` for each i, up to float rounding of the batched matrix
        products (greedy ids are verified equal in tests/unit/test_batching.py). Needs enable_batching().
        """
        if not self._batching:
            raise RuntimeError("forward_batch needs enable_batching() first")
        if len(tokens) != len(caches) or not tokens:
            raise ValueError("forward_batch needs one cache per token, and at least one")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token id outside 0..{self.vocab_size - 1}")
        positions = [int(cache.get_seq_length()) for cache in caches]
        groups: dict[Any, list[int]] = {}
        for i, position in enumerate(positions):
            groups.setdefault(self._rope_group(position), []).append(i)
        out = torch.empty(len(tokens), self.vocab_size)
        for rows in groups.values():
            ragged = _RaggedCache([caches[i] for i in rows])
            _ragged.rows = ragged.rows
            try:
                with rows_active([getattr(caches[i], "adapter", None) for i in rows]):
                    logits = self.hf(input_ids=torch.tensor([[tokens[i]] for i in rows]),
                                     position_ids=torch.tensor([[positions[i]] for i in rows]),
                                     past_key_values=ragged, use_cache=True,
                                     # A ready 4D mask makes transformers skip building masks from the ragged
                                     # cache; _ragged_attention ignores it.
                                     attention_mask=torch.ones(len(rows), 1, 1, 1, dtype=torch.bool)).logits
            finally:
                _ragged.rows = None
            out[rows] = logits[:, -1].float()
        return out


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


def load_model(artifact_dir: str | os.PathLike[str], num_threads: int | None = DEFAULT_NUM_THREADS,
               adapters: dict[str, Path] | None = None, trtllm_adapters: dict[str, Path] | None = None
               ) -> ReferenceModel:
    """Load a reference artifact directory; raises ArtifactError naming what is wrong.

    Sets torch's process-wide thread count to `num_threads` (None leaves it alone). ``adapters``: LoRA adapter
    folders by name (PEFT's files), served per request (lora.py); ``trtllm_adapters``: the same converted to
    TensorRT-LLM's format (lora_trtllm.py); AdapterError for one that does not fit.
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
    model = ReferenceModel(_load_hf(root), info)
    if adapters:
        model.lora = load_adapters(model.hf, adapters)
    elif trtllm_adapters:  # TensorRT-LLM's converted format: the stand-in serving an engine repository
        model.lora = load_trtllm_adapters(model.hf, trtllm_adapters)
    return model
