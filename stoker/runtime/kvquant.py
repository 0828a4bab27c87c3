"""Fake quantization of K/V cache entries with per-layer scales.

The reference runtime computes in float32, but a TensorRT-LLM engine built with an FP8 or
INT8 KV cache stores K/V at that precision. Rounding what we write to the cache through the
same grid (value / scale -> low precision -> back, times scale) makes the reference show the
accuracy effect of the KV quantization instead of hiding it.
"""

from __future__ import annotations

import torch

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
