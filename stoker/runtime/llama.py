"""A small pure-PyTorch Llama for the CPU reference path.

It serves the float32 "reference artifact" (HF Llama tensor names in model.safetensors,
config.json, stoker_runtime.json) inside Triton's python backend, whose image carries only
torch, numpy, safetensors and tokenizers: hence no transformers import here. Imports are
relative only, so the package also works when copied next to a Triton model.py as
`stoker_runtime`.

One sequence at a time (no batch dimension); the KV cache is preallocated per request.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .kvquant import KV_CACHE_DTYPES, fake_quantize

ARTIFACT_FORMAT = "stoker-reference/1"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
RUNTIME_FILE = "stoker_runtime.json"
DEFAULT_NUM_THREADS = 2
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
QUANT_FORMATS = ("none", "fp8", "int4_awq", "int8_sq", "w4a8_awq")


class ArtifactError(ValueError):
    """The reference artifact is missing, malformed or uses a feature this runtime lacks."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding settings; `scaling` holds the rope-type specific keys."""

    theta: float
    rope_type: str = "default"
    scaling: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LlamaSpec:
    """The architecture numbers read from config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeSpec


@dataclass(frozen=True)
class RuntimeInfo:
    """stoker_runtime.json: token ids and the quantization the reference must imitate."""

    end_id: int
    pad_id: int
    quant_format: str = "none"
    kv_cache_dtype: str | None = None
    # layer index -> (k scale, v scale)
    kv_scales: dict[int, tuple[float, float]] = field(default_factory=dict)


def _rope_spec(cfg: dict[str, Any]) -> RopeSpec:
    # transformers >= 5 writes rope_parameters (theta inside); older versions write a
    # top-level rope_theta plus an optional rope_scaling dict keyed "type" or "rope_type".
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ArtifactError(f"config.json: rope parameters must be an object, got {params!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ArtifactError(
            f"config.json: rope type {rope_type!r} is not supported by the reference runtime "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = {k: float(v) for k, v in params.items() if k not in ("rope_type", "type", "rope_theta") and v is not None}
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in scaling]
    if missing:
        raise ArtifactError(f"config.json: rope type {rope_type!r} needs {', '.join(missing)}")
    return RopeSpec(theta=theta, rope_type=rope_type, scaling=scaling)


def spec_from_config(cfg: dict[str, Any]) -> LlamaSpec:
    """Validate an HF LlamaConfig dict and keep what the forward pass needs."""
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ArtifactError("config.json: attention_bias/mlp_bias are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ArtifactError(f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        spec = LlamaSpec(
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=_rope_spec(cfg),
        )
    except KeyError as exc:
        raise ArtifactError(f"config.json: missing key {exc.args[0]!r}") from None
    if spec.num_heads % spec.num_kv_heads:
        raise ArtifactError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
    return spec


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
        return RuntimeInfo(
            end_id=int(raw["end_id"]),
            pad_id=int(raw["pad_id"]),
            quant_format=quant_format,
            kv_cache_dtype=kv_dtype,
            kv_scales=scales,
        )
    except KeyError as exc:
        raise ArtifactError(f"{RUNTIME_FILE}: missing key {exc.args[0]!r}") from None


def _inv_freq(spec: LlamaSpec) -> torch.Tensor:
    rope, dim = spec.rope, spec.head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.scaling["factor"]
    if rope.rope_type == "llama3":
        # Llama 3.1 scaling: long wavelengths are slowed down by `factor`, short ones kept,
        # and the band in between is interpolated smoothly.
        s = rope.scaling
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class KVCache:
    """Per-request K/V storage, [kv_heads, capacity, head_dim] per layer, filled front to back."""

    def __init__(self, spec: LlamaSpec, capacity: int) -> None:
        shape = (spec.num_kv_heads, capacity, spec.head_dim)
        self.k = [torch.zeros(shape) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape) for _ in range(spec.num_layers)]
        self.capacity = capacity
        self.length = 0


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Float32 Llama forward pass over a KV cache; thread-safe as long as caches are not shared."""

    def __init__(self, spec: LlamaSpec, info: RuntimeInfo, weights: dict[str, torch.Tensor]) -> None:
        self.spec = spec
        self.info = info
        self.w = weights
        self.inv_freq = _inv_freq(spec)

    @property
    def max_positions(self) -> int:
        return self.spec.max_position_embeddings

    def new_cache(self, capacity: int) -> KVCache:
        if not 0 < capacity <= self.max_positions:
            raise ValueError(f"cache capacity {capacity} outside 1..{self.max_positions}")
        return KVCache(self.spec, capacity)

    def _kv_quant(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.info.kv_cache_dtype
        if dtype is None:
            return k, v
        k_scale, v_scale = self.info.kv_scales[layer]
        return fake_quantize(k, k_scale, dtype), fake_quantize(v, v_scale, dtype)

    def _attention(self, layer: int, x: torch.Tensor, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, p = self.spec, f"model.layers.{layer}.self_attn."
        t = x.shape[0]
        q = F.linear(x, self.w[p + "q_proj.weight"]).view(t, s.num_heads, s.head_dim).transpose(0, 1)
        k = F.linear(x, self.w[p + "k_proj.weight"]).view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        v = F.linear(x, self.w[p + "v_proj.weight"]).view(t, s.num_kv_heads, s.head_dim).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        start, end = cache.length, cache.length + t
        k, v = self._kv_quant(layer, k, v)
        cache.k[layer][:, start:end] = k
        cache.v[layer][:, start:end] = v
        groups = s.num_heads // s.num_kv_heads
        keys = cache.k[layer][:, :end].repeat_interleave(groups, dim=0)
        values = cache.v[layer][:, :end].repeat_interleave(groups, dim=0)
        # Query i sits at absolute position start + i and may see keys 0..start + i.
        mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return F.linear(out.transpose(0, 1).reshape(t, s.num_heads * s.head_dim), self.w[p + "o_proj.weight"])

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp."
        gate = F.silu(F.linear(x, self.w[p + "gate_proj.weight"]))
        return F.linear(gate * F.linear(x, self.w[p + "up_proj.weight"]), self.w[p + "down_proj.weight"])

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int] | torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run `tokens` (the next positions of the sequence) and return their logits [T, vocab]."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        t = ids.shape[0]
        if t == 0:
            raise ValueError("forward needs at least one token")
        if cache.length + t > cache.capacity:
            raise ValueError(f"KV cache full: {cache.length} + {t} > {cache.capacity}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"token id outside 0..{self.spec.vocab_size - 1}")
        s = self.spec
        positions = torch.arange(cache.length, cache.length + t, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = F.embedding(ids, self.w["model.embed_tokens.weight"])
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}."
            h = h + self._attention(layer, _rms_norm(h, self.w[p + "input_layernorm.weight"], s.rms_norm_eps), cache, cos, sin)
            h = h + self._mlp(layer, _rms_norm(h, self.w[p + "post_attention_layernorm.weight"], s.rms_norm_eps))
        cache.length += t
        h = _rms_norm(h, self.w["model.norm.weight"], s.rms_norm_eps)
        return F.linear(h, self.w["lm_head.weight"])


def _expected_shapes(s: LlamaSpec) -> dict[str, tuple[int, ...]]:
    shapes = {
        "model.embed_tokens.weight": (s.vocab_size, s.hidden_size),
        "model.norm.weight": (s.hidden_size,),
        "lm_head.weight": (s.vocab_size, s.hidden_size),
    }
    q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q_dim, s.hidden_size),
            p + "self_attn.k_proj.weight": (kv_dim, s.hidden_size),
            p + "self_attn.v_proj.weight": (kv_dim, s.hidden_size),
            p + "self_attn.o_proj.weight": (s.hidden_size, q_dim),
            p + "mlp.gate_proj.weight": (s.intermediate_size, s.hidden_size),
            p + "mlp.up_proj.weight": (s.intermediate_size, s.hidden_size),
            p + "mlp.down_proj.weight": (s.hidden_size, s.intermediate_size),
            p + "input_layernorm.weight": (s.hidden_size,),
            p + "post_attention_layernorm.weight": (s.hidden_size,),
        })
    return shapes


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


def load_model(artifact_dir: str | os.PathLike[str], num_threads: int | None = DEFAULT_NUM_THREADS) -> LlamaModel:
    """Load a reference artifact directory; raises ArtifactError naming what is wrong.

    Sets torch's process-wide thread count to `num_threads` (None leaves it alone).
    """
    root = Path(artifact_dir)
    spec = spec_from_config(_read_json(root / CONFIG_FILE))
    info = runtime_info_from_dict(_read_json(root / RUNTIME_FILE), spec.num_layers)
    if not (root / WEIGHTS_FILE).is_file():
        raise ArtifactError(f"reference artifact lacks {WEIGHTS_FILE} ({root})")
    weights = load_file(str(root / WEIGHTS_FILE))
    if "lm_head.weight" not in weights and spec.tie_word_embeddings:
        weights["lm_head.weight"] = weights.get("model.embed_tokens.weight")
    for name, shape in _expected_shapes(spec).items():
        tensor = weights.get(name)
        if tensor is None:
            raise ArtifactError(f"{WEIGHTS_FILE}: missing tensor {name}")
        if tuple(tensor.shape) != shape:
            raise ArtifactError(f"{WEIGHTS_FILE}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
        if tensor.dtype != torch.float32:
            raise ArtifactError(f"{WEIGHTS_FILE}: {name} is {tensor.dtype}, expected float32")
    configure_threads(num_threads)
    return LlamaModel(spec, info, weights)
