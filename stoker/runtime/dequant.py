"""Dequantize a ModelOpt (0.47) unified HF checkpoint with its own scales, to float32.

The CPU reference serves float32 weights that compute what the quantized model computes.
Layouts below follow modelopt/torch/export/quant_utils.py (`to_quantized_weight`,
`pack_int4_in_uint8`) and unified_export_hf.py (`_export_quantized_weight`); the
integration tests compare the result with ModelOpt's own fake-quantized weights.

Only weights are dequantized: activation scales (input_scale) describe runtime activation
quantization, which the reference does not emulate; KV-cache scales are returned so the
runtime can round its cache through the same grid.

Runs in a child process (imports torch).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import StokerError
from ..plan.quant_check import read_quant_config

# quant_algo (hf_quant_config.json) -> stoker format name.
FORMATS = {
    "FP8": "fp8",
    "W8A8_SQ_PER_CHANNEL": "int8_sq",
    "W4A16_AWQ": "int4_awq",
    "W4A8_AWQ": "w4a8_awq",
}
KV_FORMATS = {"FP8": "fp8"}
# Tensors that only carry quantization metadata; none of them is a parameter of transformers' model.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale", ".k_scale", ".v_scale")
_KV_SCALE = re.compile(r"\.layers\.(\d+)\.self_attn\.([kv])_proj\.([kv])_scale$")


class DequantError(StokerError):
    """The checkpoint uses a layout this dequantizer does not know, or is inconsistent."""


def read_quantization(directory: Path) -> tuple[str, str | None, int | None]:
    """(stoker format, kv cache dtype or None, group size or None) from the exporter's config."""
    qcfg = read_quant_config(Path(directory))
    algo = qcfg.get("quant_algo")
    if algo is None:
        return "none", None, None
    if algo not in FORMATS:
        raise DequantError(f"unsupported quant_algo {algo!r}; supported: {sorted(FORMATS)}")
    kv_algo = qcfg.get("kv_cache_quant_algo")
    if kv_algo is not None and kv_algo not in KV_FORMATS:
        raise DequantError(f"unsupported kv_cache_quant_algo {kv_algo!r}; supported: {sorted(KV_FORMATS)}")
    return FORMATS[algo], KV_FORMATS.get(kv_algo) if kv_algo else None, qcfg.get("group_size")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Signed int4 values (int8 tensor, shape [2*rows, cols]) from ModelOpt's packed bytes.

    ModelOpt packs along the output dimension: byte [r, c] holds row 2r in its low nibble
    and row 2r+1 in its high nibble, each a two's-complement value in [-8, 7].
    """
    if packed.dim() != 2:
        raise DequantError(f"packed int4 weight must be 2-D, got shape {list(packed.shape)}")
    raw = packed.view(torch.uint8).to(torch.int16)
    low, high = raw & 0x0F, (raw >> 4) & 0x0F
    low = torch.where(low > 7, low - 16, low)
    high = torch.where(high > 7, high - 16, high)
    # stack on a new axis then flatten: rows come out interleaved 0 (low), 1 (high), 2, 3, ...
    return torch.stack((low, high), dim=1).reshape(packed.shape[0] * 2, packed.shape[1]).to(torch.int8)


def _group_scales(scale: torch.Tensor, in_dim: int, name: str) -> torch.Tensor:
    """Expand per-group scales [out, in/group] to one scale per weight element [out, in]."""
    groups = scale.shape[-1]
    if groups == 0 or in_dim % groups:
        raise DequantError(f"{name}: {groups} scale groups do not divide input dim {in_dim}")
    return scale.float().repeat_interleave(in_dim // groups, dim=-1)


def dequantize_weight(name: str, weight: torch.Tensor, scales: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """One linear layer's float32 weight, as the quantized layer applies it to its (unsmoothed) input.

    `scales` holds this layer's weight_scale / weight_scale_2 / pre_quant_scale, if any.
    """
    ws = scales.get("weight_scale")
    if ws is None:
        raise DequantError(f"{name}: quantized weight without weight_scale")
    ws = ws.float()
    if fmt == "fp8":
        if weight.dtype != torch.float8_e4m3fn:
            raise DequantError(f"{name}: dtype {weight.dtype}, expected float8_e4m3fn")
        # Per-tensor scale is a scalar; per-channel (if ever) one scale per output row.
        w = weight.float() * (ws if ws.dim() == 0 or ws.numel() == 1 else ws.reshape(-1, 1))
    elif fmt == "int8_sq":
        if weight.dtype != torch.int8:
            raise DequantError(f"{name}: dtype {weight.dtype}, expected int8")
        w = weight.float() * ws.reshape(-1, 1)
    elif fmt in ("int4_awq", "w4a8_awq"):
        q = unpack_int4(weight).float()
        if ws.shape[0] != q.shape[0]:
            raise DequantError(f"{name}: weight_scale rows {ws.shape[0]} != unpacked output dim {q.shape[0]}")
        w = q * _group_scales(ws, q.shape[1], name)
        if fmt == "w4a8_awq":
            # W4A8 weights go through a second, per-tensor FP8 stage (ModelOpt's sequential
            # weight quantizer; the kernel converts int4 * group scale to FP8 before the FP8 GEMM).
            ws2 = scales.get("weight_scale_2")
            if ws2 is None:
                raise DequantError(f"{name}: w4a8_awq weight without weight_scale_2")
            ws2 = ws2.float()
            w = (w / ws2).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * ws2
    else:
        raise DequantError(f"unsupported format {fmt!r}")
    pqs = scales.get("pre_quant_scale")
    if pqs is not None:
        # The layer computes W_q @ (x * pre_quant_scale); folding the smoothing factor into
        # W_q's columns gives a plain linear layer on x.
        if pqs.numel() != w.shape[1]:
            raise DequantError(f"{name}: pre_quant_scale has {pqs.numel()} entries, input dim is {w.shape[1]}")
        w = w * pqs.float().reshape(1, -1)
    return w


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in directory.glob("*.safetensors"))
    if not names:
        raise DequantError(f"{directory}: no .safetensors files")
    return [directory / n for n in names]


def load_raw(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint as stored (any dtype)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(Path(directory)):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[key] = handle.get_tensor(key)
    return tensors


def load_dequantized(directory: Path | str) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, float]]]:
    """(float32 state dict with the checkpoint's own HF names, {layer: {"k": scale, "v": scale}}).

    Architecture-agnostic by name: every `X.weight` with an `X.weight_scale` is dequantized (so fused
    projections such as Phi-3's qkv_proj/gate_up_proj too), every other float tensor (biases such as
    Qwen2's q_proj.bias, norms, embeddings) passes through. ModelOpt files K/V scales under
    self_attn.k_proj/v_proj even where the model fuses them (Phi-3); the runtime's strict load then
    refuses any name transformers' class does not expect.

    An unquantized checkpoint comes back cast to float32 with no KV scales.

    Raises:
        DequantError: unknown quant_algo, a quantized weight without its scales, or
            scales whose shapes do not fit the weight.
    """
    directory = Path(directory)
    fmt, kv, _group = read_quantization(directory)
    raw = load_raw(directory)
    state: dict[str, torch.Tensor] = {}
    kv_scales: dict[int, dict[str, float]] = {}
    for key, tensor in raw.items():
        match = _KV_SCALE.search(key)
        if match:
            kv_scales.setdefault(int(match.group(1)), {})[match.group(3)] = float(tensor.float().reshape(-1)[0])
            continue
        if key.endswith(SCALE_SUFFIXES):
            continue
        if key.endswith(".weight") and f"{key}_scale" in raw:
            module = key[: -len(".weight")]
            scales = {s: raw[f"{module}.{s}"] for s in ("weight_scale", "weight_scale_2", "pre_quant_scale")
                      if f"{module}.{s}" in raw}
            state[key] = dequantize_weight(key, tensor, scales, fmt)
        else:
            if not tensor.is_floating_point() or tensor.dtype == torch.float8_e4m3fn:
                raise DequantError(f"{key}: {tensor.dtype} tensor without a weight_scale")
            state[key] = tensor.float()
    if kv is None and kv_scales:
        raise DequantError("checkpoint has k/v scales but no kv_cache_quant_algo")
    for layer, pair in sorted(kv_scales.items()):
        if set(pair) != {"k", "v"}:
            raise DequantError(f"layer {layer}: KV cache scales {sorted(pair)}, expected k and v")
    return state, kv_scales
