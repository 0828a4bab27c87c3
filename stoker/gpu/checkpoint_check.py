"""Structural checks of quantized checkpoints (standard library only: runs in the image too).

Reads config JSON and safetensors headers, never tensors: the quant algorithm recorded,
the KV-cache algorithm, one rank file per TP×PP rank, and quantized dtypes present.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# stoker format → TRT-LLM QuantAlgo names ModelOpt records (config.json "quantization.quant_algo" for the
# TRT-LLM checkpoint, hf_quant_config.json "quantization.quant_algo" for the unified one).
QUANT_ALGOS: dict[str, set[str | None]] = {
    "none": {None},
    "fp8": {"FP8"},
    "fp8_pc_pt": {"FP8_PER_CHANNEL_PER_TOKEN"},
    "int8_sq": {"W8A8_SQ_PER_CHANNEL"},
    "int8_wo": {"W8A16"},
    "int4_wo": {"W4A16", "W4A16_AWQ"},
    "int4_awq": {"W4A16_AWQ"},
    "w4a8_awq": {"W4A8_AWQ"},
    "nvfp4": {"NVFP4"},
}
KV_ALGOS = {"none": {None}, "fp8": {"FP8"}, "int8": {"INT8"}}
QUANTIZED_DTYPES = {"F8_E4M3", "I8", "U8", "I4"}


class CheckpointError(Exception):
    """An exported checkpoint does not have the structure its format promises (one line)."""


def safetensors_dtypes(path: Path) -> dict[str, str]:
    """tensor name → dtype, from the file's JSON header only."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _algo(quant: dict, key: str) -> str | None:
    v = quant.get(key)
    return None if v in (None, "", "null") else str(v)


def _verify(where: str, quant: dict, fmt: str, kv: str, dtypes: set[str]) -> dict:
    algo, kv_algo = _algo(quant, "quant_algo"), _algo(quant, "kv_cache_quant_algo")
    if algo not in QUANT_ALGOS[fmt]:
        raise CheckpointError(f"{where}: quant_algo {algo!r}, expected {sorted(map(str, QUANT_ALGOS[fmt]))} "
                              f"for format {fmt!r}")
    if kv_algo not in KV_ALGOS[kv]:
        raise CheckpointError(f"{where}: kv_cache_quant_algo {kv_algo!r}, expected {kv!r}")
    if fmt != "none" and not dtypes & QUANTIZED_DTYPES:
        raise CheckpointError(f"{where}: no quantized tensor (dtypes {sorted(dtypes)})")
    return {"quant_algo": algo, "kv_cache_quant_algo": kv_algo, "dtypes": sorted(dtypes)}


def check_trtllm_checkpoint(folder: Path, fmt: str, kv: str, world_size: int) -> dict:
    """TRT-LLM checkpoint: config.json (mapping, quantization) + rank{i}.safetensors for every rank."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}/config.json unreadable: {err}") from None
    mapping = config.get("mapping", {})
    if int(mapping.get("world_size", 1)) != world_size:
        raise CheckpointError(f"{folder}: mapping.world_size {mapping.get('world_size')}, expected {world_size}")
    ranks = sorted(p.name for p in folder.glob("rank*.safetensors"))
    want = [f"rank{i}.safetensors" for i in range(world_size)]
    if sorted(ranks) != sorted(want):
        raise CheckpointError(f"{folder}: rank files {ranks}, expected {want}")
    dtypes = set().union(*(safetensors_dtypes(folder / r).values() for r in ranks))
    out = _verify(str(folder), config.get("quantization") or {}, fmt, kv, dtypes)
    return out | {"architecture": config.get("architecture"), "dtype": config.get("dtype"), "ranks": len(ranks)}


def check_unified_checkpoint(folder: Path, fmt: str, kv: str) -> dict:
    """Unified HF checkpoint: hf_quant_config.json + safetensors + config.json + tokenizer."""
    folder = Path(folder)
    try:
        quant = json.loads((folder / "hf_quant_config.json").read_text()).get("quantization", {})
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}/hf_quant_config.json unreadable: {err}") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files or not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder}: no config.json or *.safetensors")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise CheckpointError(f"{folder}: no tokenizer (tokenizer.json/tokenizer.model)")
    dtypes = set().union(*(safetensors_dtypes(f).values() for f in files))
    return _verify(str(folder), quant, fmt, kv, dtypes) | {"files": len(files)}
