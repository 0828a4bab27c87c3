"""A quantized checkpoint with deliberately damaged scales, published into stoker's step cache as if the
quantize step had produced it: the fault a broken quantizer or exporter leaves behind (wrong scales,
well-formed file). Used by the evaluation-gate test and benchmarks/quality.py."""

from __future__ import annotations

import shutil
from pathlib import Path

DAMAGE = {0: 16.0, 1: 1 / 16}  # layer → factor on every weight_scale of that layer


def damage_scales(src: Path, dst: Path, damage: dict[int, float] = DAMAGE) -> int:
    """Copy a ModelOpt checkpoint from src to dst with its layers' weight scales multiplied; returns how many."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    changed = 0
    for name in list(tensors):
        layer = name.split(".layers.")[1].split(".")[0] if ".layers." in name else None
        if name.endswith(".weight_scale") and layer is not None and int(layer) in damage:
            tensors[name] = (tensors[name].float() * damage[int(layer)]).to(tensors[name].dtype)
            changed += 1
    if not changed:
        raise ValueError(f"{src}: no weight_scale tensors to damage")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return changed


def publish_damaged(store_root: Path, key: str, good_checkpoint: Path) -> None:
    """Put a damaged copy of good_checkpoint in the step cache under quantize key `key`."""
    from stoker.storage.store import StepStore

    StepStore(store_root).publish("quantize", key, lambda out: {
        "format": "fp8", "damaged_scales": damage_scales(good_checkpoint, out)})
