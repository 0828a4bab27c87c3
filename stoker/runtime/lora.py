"""LoRA adapters on a ReferenceModel, chosen per sequence, computed as PEFT computes them.

Each targeted linear layer of the served model is wrapped once: its output is the base layer's, plus, for the rows
of the batch whose sequence asked for adapter k, lora_B_k(lora_A_k(x)) · s_k — PEFT's own expression, in the same
order, in float32 like the base. The adapter of a row comes from the sequence's cache (new_cache(adapter=…)), so
sequences for different adapters and for the base share one batched forward pass (stoker_runtime.batch).

Imports are relative only (the package is copied next to a Triton model.py as `stoker_runtime`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .lora_config import WEIGHTS_FILE, AdapterError, check_shapes, module_of, read_config

_rows = threading.local()  # the adapter index of each batch row in the forward running on this thread


class LoraLinear(torch.nn.Module):
    """A base nn.Linear plus the adapters that target it; which apply is per row (rows_active)."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    @property
    def weight(self) -> torch.Tensor:  # what code reading the layer's weight expects
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows: Sequence[int | None] | None = getattr(_rows, "value", None)
        if not rows or not self.adapters:
            return out
        for index in sorted({r for r in rows if r is not None and r in self.adapters}):
            a, b, scaling = self.adapters[index]
            picked = [i for i, r in enumerate(rows) if r == index]
            if len(picked) == len(rows):
                out = out + F.linear(F.linear(x, a), b) * scaling
            else:
                out = out.clone()
                out[picked] = out[picked] + F.linear(F.linear(x[picked], a), b) * scaling
        return out


class rows_active:
    """Within the block, row i of the model's forward uses adapter ``rows[i]`` (None: the base alone)."""

    def __init__(self, rows: Sequence[int | None]) -> None:
        self.rows = list(rows) if any(r is not None for r in rows) else None

    def __enter__(self) -> None:
        self.before = getattr(_rows, "value", None)
        _rows.value = self.rows

    def __exit__(self, *exc: Any) -> None:
        _rows.value = self.before


class Adapters:
    """The adapters a model serves: name → index, loaded into its wrapped linear layers."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.layers: dict[str, int] = {}  # name → how many layers it changes

    def resolve(self, name: str | None) -> int | None:
        """The index of adapter ``name`` (None or "": the base); ValueError naming the known ones otherwise."""
        if not name:
            return None
        try:
            return self.index[name]
        except KeyError:
            known = ", ".join(sorted(self.index)) or "none"
            raise ValueError(f"unknown adapter {name!r} (served: {known})") from None


def load_adapters(hf_model: Any, folders: dict[str, Path]) -> Adapters:
    """Load each adapter folder (adapter_config.json + adapter_model.safetensors) into ``hf_model``; raises
    AdapterError (one line) for one that does not fit it."""
    from safetensors.torch import load_file

    out = Adapters()
    base_config = hf_model.config.get_text_config(decoder=True).to_dict()
    modules = dict(hf_model.named_modules())
    for index, (name, folder) in enumerate(sorted(folders.items())):
        where = f"adapter {name}"
        cfg = read_config(folder, where)
        weights_file = folder / WEIGHTS_FILE
        if not weights_file.is_file():
            raise AdapterError(f"{where}: no {WEIGHTS_FILE} (safetensors only; pickled weights are refused)")
        tensors = load_file(str(weights_file))
        out.layers[name] = check_shapes({k: tuple(v.shape) for k, v in tensors.items()}, cfg, base_config, where)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            module, ab = module_of(key)
            pairs.setdefault(module, {})[ab] = tensor.to(torch.float32)
        _install(hf_model, modules, {m: (ab["A"], ab["B"]) for m, ab in pairs.items()}, index, cfg.scaling, where)
        out.index[name] = index
    return out


def load_trtllm_adapters(hf_model: Any, folders: dict[str, Path]) -> Adapters:
    """Load adapters converted to TensorRT-LLM's format (lora_trtllm.py: a folder with model.lora_weights.npy and
    model.lora_config.npy, the scaling folded into B), as the stand-in serves an engine repository's
    lora_prefetch_dir; AdapterError (one line) for one that does not fit."""
    import numpy as np

    from .lora_config import LINEAR_MODULES, expected_shapes
    from .lora_trtllm import CONFIG_NPY, WEIGHTS_NPY, from_trtllm

    out = Adapters()
    base_config = hf_model.config.get_text_config(decoder=True).to_dict()
    linear = LINEAR_MODULES.get(base_config.get("model_type", ""), ())
    modules = dict(hf_model.named_modules())
    for index, (name, folder) in enumerate(sorted(folders.items())):
        where = f"adapter {name} ({folder.name})"
        try:
            weights, config = np.load(folder / WEIGHTS_NPY), np.load(folder / CONFIG_NPY)
            pairs = from_trtllm(weights, config, linear, lambda m: expected_shapes(base_config, m))
        except (OSError, ValueError) as err:
            raise AdapterError(f"{where}: {err}") from None
        _install(hf_model, modules, {m: (torch.from_numpy(a), torch.from_numpy(b)) for m, (a, b) in pairs.items()},
                 index, 1.0, where)
        out.index[name] = index
        out.layers[name] = len(pairs)
    return out


def _install(hf_model: Any, modules: dict[str, Any], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], index: int,
             scaling: float, where: str) -> None:
    for module, (a, b) in pairs.items():
        layer = modules.get(module)
        if isinstance(layer, torch.nn.Linear):
            layer = _wrap(hf_model, module, layer)
            modules[module] = layer
        if not isinstance(layer, LoraLinear):
            raise AdapterError(f"{where}: {module} is not a linear layer of {type(hf_model).__name__}")
        layer.adapters[index] = (a, b, scaling)


def _wrap(hf_model: Any, path: str, layer: torch.nn.Linear) -> LoraLinear:
    parent_path, _, attr = path.rpartition(".")
    parent = hf_model.get_submodule(parent_path) if parent_path else hf_model
    wrapped = LoraLinear(layer)
    setattr(parent, attr, wrapped)
    return wrapped
