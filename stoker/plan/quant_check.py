"""Structural check of a ModelOpt unified HF checkpoint, without torch.

transformers cannot reload these checkpoints faithfully (FP8/INT8 weights load without
their scales), so we check what the exporter wrote instead: the quantization algorithm in
hf_quant_config.json / config.json, and the dtype and shape of every projection weight and
its scale tensors, read straight from the safetensors JSON headers (stdlib only, so the
orchestrator can run it in-process).
"""

from __future__ import annotations

import fnmatch
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StokerError

# stoker format -> the quant_algo ModelOpt 0.47 writes for it.
QUANT_ALGOS = {
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
}
KV_ALGOS = {"fp8": "FP8", "int8": "INT8"}
FLOAT_DTYPES = ("F32", "F16", "BF16")
# Headers larger than this are not a safetensors file we wrote; refuse before reading them.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_LAYER = re.compile(r"^(.*\.layers\.(\d+))\.")


class QuantCheckError(StokerError):
    """The checkpoint does not have the structure its quantization format implies."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class CheckReport:
    """What the check found; counts let callers log a one-line summary."""

    format: str
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    group_size: int | None
    quantized_weights: int
    kv_scaled_layers: int
    tensors: int
    files: tuple[str, ...] = field(default_factory=tuple)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file's header: 8-byte little-endian length, then JSON."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise QuantCheckError(f"{path.name}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise QuantCheckError(f"{path.name}: header length {length} is implausible")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantCheckError(f"{path.name}: unreadable safetensors header ({exc})") from None
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = TensorInfo(dtype=str(entry["dtype"]), shape=tuple(int(d) for d in entry["shape"]), file=path.name)
    return out


def read_checkpoint_tensors(directory: Path) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint: the files its index names, else every *.safetensors."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise QuantCheckError(f"{directory}: no .safetensors files")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        if not (directory / name).exists():
            raise QuantCheckError(f"{directory}: index names missing shard {name}")
        for key, info in read_safetensors_header(directory / name).items():
            if key in tensors:
                raise QuantCheckError(f"tensor {key} appears in both {tensors[key].file} and {name}")
            tensors[key] = info
    return tensors


def read_quant_config(directory: Path) -> dict:
    """The exporter's quantization section: hf_quant_config.json, else config.json's quantization_config."""
    directory = Path(directory)
    hf_quant = directory / "hf_quant_config.json"
    if hf_quant.exists():
        return dict(json.loads(hf_quant.read_text()).get("quantization") or {})
    config = directory / "config.json"
    if not config.exists():
        raise QuantCheckError(f"{directory}: no config.json")
    section = dict(json.loads(config.read_text()).get("quantization_config") or {})
    # config.json spells the KV cache as a compressed-tensors style scheme instead.
    scheme = section.get("kv_cache_scheme")
    if "kv_cache_quant_algo" not in section and isinstance(scheme, dict):
        if scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            section["kv_cache_quant_algo"] = "FP8"
        elif scheme.get("type") == "int" and scheme.get("num_bits") == 8:
            section["kv_cache_quant_algo"] = "INT8"
    return section


def _expect(tensors: dict[str, TensorInfo], name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None) -> None:
    info = tensors.get(name)
    if info is None:
        raise QuantCheckError(f"{name}: missing")
    if info.dtype not in dtypes:
        raise QuantCheckError(f"{name}: dtype {info.dtype}, expected {'/'.join(dtypes)}")
    if shape is not None and info.shape != shape:
        raise QuantCheckError(f"{name}: shape {list(info.shape)}, expected {list(shape)}")


def _check_weight(tensors: dict[str, TensorInfo], module: str, fmt: str, group_size: int | None) -> None:
    """Check one quantized linear layer's weight and scales against the format's layout."""
    weight = tensors[f"{module}.weight"]
    scalar: tuple[int, ...] = ()
    if fmt == "fp8":
        _expect(tensors, f"{module}.weight", ("F8_E4M3",), None)
        # Per-tensor FP8: scalar scales (shape [] in 0.47's export).
        _expect(tensors, f"{module}.weight_scale", ("F32",), scalar)
        _expect(tensors, f"{module}.input_scale", ("F32",), scalar)
        return
    if fmt == "int8_sq":
        _expect(tensors, f"{module}.weight", ("I8",), None)
        out_dim, in_dim = weight.shape
        _expect(tensors, f"{module}.weight_scale", ("F32",), (out_dim,))
        _expect(tensors, f"{module}.input_scale", ("F32",), scalar)
        # SmoothQuant keeps the smoothing factors as pre_quant_scale on every linear.
        _expect(tensors, f"{module}.pre_quant_scale", FLOAT_DTYPES, (in_dim,))
        return
    # int4_awq / w4a8_awq: two signed nibbles per byte along the output dimension.
    _expect(tensors, f"{module}.weight", ("U8", "I8"), None)
    if len(weight.shape) != 2:
        raise QuantCheckError(f"{module}.weight: packed int4 weight must be 2-D, got {list(weight.shape)}")
    out_dim, in_dim = weight.shape[0] * 2, weight.shape[1]
    if group_size is None or group_size <= 0 or in_dim % group_size:
        raise QuantCheckError(f"{module}.weight: input dim {in_dim} not divisible by group_size {group_size}")
    _expect(tensors, f"{module}.weight_scale", ("F32", "F16", "BF16"), (out_dim, in_dim // group_size))
    # AWQ scales of linears that share a layernorm are fused into it; the rest keep them.
    if f"{module}.pre_quant_scale" in tensors:
        _expect(tensors, f"{module}.pre_quant_scale", FLOAT_DTYPES, (in_dim,))
    if fmt == "w4a8_awq":
        _expect(tensors, f"{module}.weight_scale_2", ("F32",), scalar)
        _expect(tensors, f"{module}.input_scale", ("F32",), scalar)


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(module == p or fnmatch.fnmatchcase(module, p) for p in patterns)


def _check_unquantized(directory: Path, tensors: dict[str, TensorInfo]) -> CheckReport:
    if read_quant_config(directory):
        raise QuantCheckError("format 'none' but the checkpoint carries a quantization config")
    for name, info in sorted(tensors.items()):
        if info.dtype not in FLOAT_DTYPES:
            raise QuantCheckError(f"{name}: dtype {info.dtype} in an unquantized checkpoint")
    return CheckReport("none", None, None, None, 0, 0, len(tensors), tuple(sorted({t.file for t in tensors.values()})))


def check_checkpoint(directory: Path | str, expected_format: str, kv_cache_dtype: str | None) -> CheckReport:
    """Check that `directory` holds a unified HF checkpoint in `expected_format`.

    Raises:
        QuantCheckError: one line naming the first offending tensor or config key, e.g.
            "model.layers.0.mlp.up_proj.weight: dtype BF16, expected F8_E4M3".
    """
    directory = Path(directory)
    kv = None if kv_cache_dtype in (None, "none") else kv_cache_dtype
    tensors = read_checkpoint_tensors(directory)
    if expected_format == "none":
        if kv is not None:
            raise QuantCheckError(f"kv_cache_dtype {kv} needs a quantized weight format")
        return _check_unquantized(directory, tensors)
    if expected_format not in QUANT_ALGOS:
        raise QuantCheckError(f"unknown format {expected_format!r}; expected one of {sorted(QUANT_ALGOS)} or 'none'")
    if kv is not None and kv not in KV_ALGOS:
        raise QuantCheckError(f"unknown kv_cache_dtype {kv!r}; expected one of {sorted(KV_ALGOS)}")

    qcfg = read_quant_config(directory)
    algo = qcfg.get("quant_algo")
    if algo != QUANT_ALGOS[expected_format]:
        raise QuantCheckError(f"quant_algo {algo!r}, expected {QUANT_ALGOS[expected_format]!r} for {expected_format}")
    kv_algo = qcfg.get("kv_cache_quant_algo")
    expected_kv = KV_ALGOS[kv] if kv else None
    if kv_algo != expected_kv:
        raise QuantCheckError(f"kv_cache_quant_algo {kv_algo!r}, expected {expected_kv!r}")
    group_size = qcfg.get("group_size")
    if expected_format in ("int4_awq", "w4a8_awq") and not isinstance(group_size, int):
        raise QuantCheckError(f"quant config lacks an integer group_size for {expected_format}")
    excluded = [str(p) for p in qcfg.get("exclude_modules") or []]

    modules = sorted(name[: -len(".weight")] for name in tensors if re.search(r"_proj\.weight$", name))
    quantized = [m for m in modules if not _excluded(m, excluded)]
    if not quantized:
        raise QuantCheckError("no quantized *_proj weights found")
    for module in quantized:
        _check_weight(tensors, module, expected_format, group_size)

    # Layer index -> its name prefix (e.g. "model.layers.3"), for the per-layer KV scales.
    layers = {int(m.group(2)): m.group(1) for name in tensors if (m := _LAYER.match(name))}
    kv_scales = sorted(name for name in tensors if name.endswith((".k_scale", ".v_scale")))
    if expected_kv is None and kv_scales:
        raise QuantCheckError(f"{kv_scales[0]}: KV cache scale present but kv_cache_dtype is none")
    if expected_kv is not None:
        for layer in sorted(layers):
            for proj, suffix in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
                _expect(tensors, f"{layers[layer]}.self_attn.{proj}.{suffix}", ("F32",), ())
    return CheckReport(
        format=expected_format,
        quant_algo=algo,
        kv_cache_quant_algo=kv_algo,
        group_size=group_size if isinstance(group_size, int) else None,
        quantized_weights=len(quantized),
        kv_scaled_layers=len(layers) if expected_kv else 0,
        tensors=len(tensors),
        files=tuple(sorted({t.file for t in tensors.values()})),
    )
