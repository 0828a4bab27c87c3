"""LoRA adapters in TensorRT-LLM's format: what its engine backend preloads from ``lora_prefetch_dir`` (numeric
folders named by task id, each with model.lora_weights.npy and model.lora_config.npy). No torch.

One row per (layer, module) the adapter changes. The config row is [module id, layer, rank] (TensorRT-LLM's
LoraManager ids). The weights row holds A ([rank, in], row-major) and then B · s ([out, rank]): PEFT's scaling s is
folded into B, as TensorRT-LLM's converter (hf_lora_convert.py) does. Rows are padded with zeros to the longest.
The halves of a fused gate_up_proj's B are swapped: TensorRT-LLM's fused MLP takes up before gate, transformers'
Phi-3 gate before up.

Written by the package step (stoker/gpu/lora.py) for `target: tensorrt`, and read back by the reference runtime
when the stand-in serves such a repository (model.py), so the conversion is exercised by every stand-in run and its
inverse is checked against PEFT (tests/unit/test_lora_trtllm.py).

Imports are relative only (the package is copied next to a Triton model.py as `stoker_runtime`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from .lora_config import AdapterConfig, AdapterError, module_of

WEIGHTS_NPY = "model.lora_weights.npy"
CONFIG_NPY = "model.lora_config.npy"
# TensorRT-LLM's LoraManager.LORA_MODULE_IDS (decoder modules) and transformers' names for them.
MODULE_IDS = {"attn_qkv": 0, "attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5,
              "mlp_4h_to_h": 6, "mlp_gate": 7}
HF_TO_TRTLLM = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "qkv_proj": "attn_qkv",
                "o_proj": "attn_dense", "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h",
                "gate_up_proj": "mlp_h_to_4h"}
_ATTENTION = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _swap_halves(b: np.ndarray) -> np.ndarray:
    half = b.shape[0] // 2
    return np.concatenate([b[half:], b[:half]], axis=0)


def to_trtllm(tensors: dict[str, np.ndarray], cfg: AdapterConfig, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's tensors (name → array) as TensorRT-LLM's (weights [1, rows, width] of ``dtype``, config [1, rows, 3]
    int32); AdapterError for a module TensorRT-LLM has no id for."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        found = module_of(key)
        if found is None:
            raise AdapterError(f"tensor {key} is not a LoRA A or B weight")
        pairs.setdefault(found[0], {})[found[1]] = np.asarray(tensor, dtype=np.float32)
    rows = []
    for module, ab in pairs.items():
        name = module.rsplit(".", 1)[-1]
        layer = _LAYER.search(module)
        if name not in HF_TO_TRTLLM or layer is None:
            raise AdapterError(f"{module}: TensorRT-LLM's LoRA has no module for it "
                               f"(it takes {', '.join(sorted(HF_TO_TRTLLM))} of a decoder layer)")
        a, b = ab["A"], ab["B"] * np.float32(cfg.scaling)
        if name == "gate_up_proj":
            b = _swap_halves(b)
        rows.append(((int(layer[1]), MODULE_IDS[HF_TO_TRTLLM[name]]), cfg.r, np.concatenate([a.ravel(), b.ravel()])))
    rows.sort(key=lambda row: row[0])
    width = max(len(w) for _, _, w in rows)
    weights = np.zeros((1, len(rows), width), dtype=np.dtype(dtype))
    for i, (_, _, w) in enumerate(rows):
        weights[0, i, :len(w)] = w
    config = np.array([[[module_id, layer, r] for (layer, module_id), r, _ in rows]], dtype=np.int32)
    return weights, config


def from_trtllm(weights: np.ndarray, config: np.ndarray, linear_modules: tuple[str, ...],
                shape_of: Callable[[str], tuple[int, int] | None]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The inverse: module path in a transformers decoder → (A [r, in], B·s [out, r]) in float32.

    ``linear_modules``: the architecture's targetable linear layers (lora_config.LINEAR_MODULES), which say which
    transformers module an id stands for; ``shape_of(name)``: its (in, out) features."""
    by_id = {MODULE_IDS[HF_TO_TRTLLM[name]]: name for name in linear_modules}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for row, (module_id, layer, r) in zip(weights.reshape(-1, weights.shape[-1]), config.reshape(-1, 3)):
        name = by_id.get(int(module_id))
        shape = shape_of(name) if name else None
        if name is None or shape is None:
            raise AdapterError(f"lora_config row [{module_id}, {layer}, {r}]: module id {module_id} is none of "
                               f"{', '.join(linear_modules)}")
        n_in, n_out = shape
        if len(row) < r * (n_in + n_out):
            raise AdapterError(f"lora_weights row of layer {layer}, {name}: {len(row)} values, rank {r} needs "
                               f"{r * (n_in + n_out)}")
        flat = row.astype(np.float32)
        a = flat[:r * n_in].reshape(r, n_in)
        b = flat[r * n_in:r * (n_in + n_out)].reshape(n_out, r)
        if name == "gate_up_proj":
            b = _swap_halves(b)
        block = "self_attn" if name in _ATTENTION else "mlp"
        out[f"model.layers.{int(layer)}.{block}.{name}"] = (a, b)
    return out
