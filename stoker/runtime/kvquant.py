"""Fake quantization of K/V cache entries with per-layer scales.

The reference runtime computes in float32, but a TensorRT-LLM engine built with an FP8 or
INT8 KV cache stores K/V at that precision. Rounding what we write to the cache through the
same grid (value / scale -> low precision -> back, times scale) makes the reference show the
accuracy effect of the KV quantization instead of hiding it. `FakeQuantCache` does it where K
and V enter transformers' cache: after the rotary embedding, as TensorRT-LLM writes its cache, and
the attention of the same step already reads the rounded values back, as an engine's does.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

KV_CACHE_DTYPES = ("fp8", "int8")

# Largest finite float8_e4m3fn value. Casting anything larger to float8_e4m3fn gives NaN
# (torch does not saturate), while TensorRT-LLM's FP8 KV cache saturates: clamp first.
FP8_E4M3_MAX = 448.0
INT8_MIN, INT8_MAX = -128.0, 127.0


def fake_quantize(x: torch.Tensor, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """Round `x` through `kv_cache_dtype` with `scale` (dequantized value = stored * scale)."""
    if scale <= 0.0:
        raise ValueError(f"KV cache scale must be positive, got {scale}")
    scaled = x / scale
    if kv_cache_dtype == "fp8":
        stored = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    elif kv_cache_dtype == "int8":
        stored = scaled.round().clamp(INT8_MIN, INT8_MAX)
    else:
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")
    return stored * scale


class FakeQuantCache(DynamicCache):
    """transformers' DynamicCache that stores K/V rounded through `kv_cache_dtype` with per-layer scales.

    Built from the model config so sliding-window layers (Mistral) are laid out as transformers'
    own generate lays them out. Without a dtype it is a plain DynamicCache.
    """

    def __init__(self, config, kv_cache_dtype: str | None = None,
                 scales: dict[int, tuple[float, float]] | None = None) -> None:
        super().__init__(config=config)
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected one of {KV_CACHE_DTYPES}")
        self.kv_cache_dtype = kv_cache_dtype
        self.scales = dict(scales or {})

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.kv_cache_dtype is not None:
            try:
                k_scale, v_scale = self.scales[layer_idx]
            except KeyError:
                raise ValueError(f"no KV cache scales for layer {layer_idx}") from None
            key_states = fake_quantize(key_states, k_scale, self.kv_cache_dtype)
            value_states = fake_quantize(value_states, v_scale, self.kv_cache_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
