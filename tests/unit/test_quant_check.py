"""quant_check on small synthetic safetensors files, written here with the stdlib.

The layouts mirror what ModelOpt 0.47's export_hf_checkpoint writes (seen on real exports:
tests/integration/test_quantize.py checks those).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.plan.quant_check import (
    QuantCheckError,
    check_checkpoint,
    read_safetensors_header,
)

HIDDEN, KV_DIM, INTER, LAYERS, GROUP = 256, 64, 512, 2, 128
ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}
ALGOS = {"fp8": "FP8", "int8_sq": "W8A8_SQ_PER_CHANNEL", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ"}
PROJS = {  # name -> (out, in)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV_DIM, HIDDEN), "self_attn.v_proj": (KV_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A valid safetensors file of zeros: 8-byte header length, JSON header, then the data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in sorted(tensors.items()):
        size = ITEM_BYTES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def layer_tensors(fmt: str, kv: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    t: dict[str, tuple[str, tuple[int, ...]]] = {
        "model.embed_tokens.weight": ("BF16", (2048, HIDDEN)),
        "lm_head.weight": ("BF16", (2048, HIDDEN)),
        "model.norm.weight": ("BF16", (HIDDEN,)),
    }
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        t[f"{p}.input_layernorm.weight"] = ("BF16", (HIDDEN,))
        t[f"{p}.post_attention_layernorm.weight"] = ("BF16", (HIDDEN,))
        for proj, (out_dim, in_dim) in PROJS.items():
            m = f"{p}.{proj}"
            if fmt == "none":
                t[f"{m}.weight"] = ("BF16", (out_dim, in_dim))
            elif fmt == "fp8":
                t[f"{m}.weight"] = ("F8_E4M3", (out_dim, in_dim))
                t[f"{m}.weight_scale"] = ("F32", ())
                t[f"{m}.input_scale"] = ("F32", ())
            elif fmt == "int8_sq":
                t[f"{m}.weight"] = ("I8", (out_dim, in_dim))
                t[f"{m}.weight_scale"] = ("F32", (out_dim,))
                t[f"{m}.input_scale"] = ("F32", ())
                t[f"{m}.pre_quant_scale"] = ("BF16", (in_dim,))
            else:
                t[f"{m}.weight"] = ("U8", (out_dim // 2, in_dim))
                t[f"{m}.weight_scale"] = ("F32", (out_dim, in_dim // GROUP))
                if proj in ("self_attn.o_proj", "mlp.down_proj"):  # the others are fused into layernorms
                    t[f"{m}.pre_quant_scale"] = ("BF16", (in_dim,))
                if fmt == "w4a8_awq":
                    t[f"{m}.weight_scale_2"] = ("F32", ())
                    t[f"{m}.input_scale"] = ("F32", ())
        if kv:
            t[f"{p}.self_attn.k_proj.k_scale"] = ("F32", ())
            t[f"{p}.self_attn.v_proj.v_scale"] = ("F32", ())
    return t


def make_checkpoint(root: Path, fmt: str, kv: bool = False, tensors: dict | None = None,
                    quant: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / "model.safetensors", tensors if tensors is not None else layer_tensors(fmt, kv))
    config = {"model_type": "llama", "num_hidden_layers": LAYERS}
    if fmt != "none":
        section = {"quant_algo": ALGOS[fmt], "kv_cache_quant_algo": "FP8" if kv else None,
                   "exclude_modules": ["lm_head", "model.embed_tokens"]}
        if fmt in ("int4_awq", "w4a8_awq"):
            section |= {"group_size": GROUP, "has_zero_point": False, "pre_quant_scale": True}
        section |= quant or {}
        hf_quant = {"producer": {"name": "modelopt"}, "quantization": section}
        (root / "hf_quant_config.json").write_text(json.dumps(hf_quant))
        config["quantization_config"] = {"quant_algo": section["quant_algo"], "quant_method": "modelopt"}
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.mark.parametrize("fmt", ["fp8", "int8_sq", "int4_awq", "w4a8_awq"])
def test_each_format_passes_and_reports(tmp_path, fmt):
    report = check_checkpoint(make_checkpoint(tmp_path, fmt), fmt, None)
    assert report.quant_algo == ALGOS[fmt]
    assert report.quantized_weights == LAYERS * len(PROJS)
    assert report.kv_cache_quant_algo is None and report.kv_scaled_layers == 0
    assert report.group_size == (GROUP if "awq" in fmt else None)
    assert report.files == ("model.safetensors",)


def test_fp8_kv_cache_scales_checked_per_layer(tmp_path):
    report = check_checkpoint(make_checkpoint(tmp_path, "fp8", kv=True), "fp8", "fp8")
    assert report.kv_cache_quant_algo == "FP8" and report.kv_scaled_layers == LAYERS


def test_missing_v_scale_names_the_tensor(tmp_path):
    tensors = layer_tensors("fp8", kv=True)
    del tensors["model.layers.1.self_attn.v_proj.v_scale"]
    ckpt = make_checkpoint(tmp_path, "fp8", kv=True, tensors=tensors)
    with pytest.raises(QuantCheckError, match=r"^model\.layers\.1\.self_attn\.v_proj\.v_scale: missing$"):
        check_checkpoint(ckpt, "fp8", "fp8")


def test_kv_scales_without_kv_request_are_rejected(tmp_path):
    tensors = layer_tensors("fp8", kv=True)
    ckpt = make_checkpoint(tmp_path, "fp8", tensors=tensors)
    with pytest.raises(QuantCheckError, match=r"k_scale: KV cache scale present"):
        check_checkpoint(ckpt, "fp8", None)


def test_kv_algo_mismatch(tmp_path):
    with pytest.raises(QuantCheckError, match=r"kv_cache_quant_algo None, expected 'FP8'"):
        check_checkpoint(make_checkpoint(tmp_path, "fp8"), "fp8", "fp8")


def test_unquantized_weight_in_fp8_checkpoint_names_first_offender(tmp_path):
    tensors = layer_tensors("fp8", kv=False)
    tensors["model.layers.0.mlp.up_proj.weight"] = ("BF16", (INTER, HIDDEN))
    ckpt = make_checkpoint(tmp_path, "fp8", tensors=tensors)
    with pytest.raises(QuantCheckError) as err:
        check_checkpoint(ckpt, "fp8", None)
    assert str(err.value) == "model.layers.0.mlp.up_proj.weight: dtype BF16, expected F8_E4M3"


def test_missing_weight_scale(tmp_path):
    tensors = layer_tensors("int8_sq", kv=False)
    del tensors["model.layers.1.self_attn.o_proj.weight_scale"]
    ckpt = make_checkpoint(tmp_path, "int8_sq", tensors=tensors)
    with pytest.raises(QuantCheckError, match=r"^model\.layers\.1\.self_attn\.o_proj\.weight_scale: missing$"):
        check_checkpoint(ckpt, "int8_sq", None)


def test_int8_per_channel_scale_shape(tmp_path):
    tensors = layer_tensors("int8_sq", kv=False)
    tensors["model.layers.0.self_attn.k_proj.weight_scale"] = ("F32", ())
    ckpt = make_checkpoint(tmp_path, "int8_sq", tensors=tensors)
    with pytest.raises(QuantCheckError, match=r"k_proj\.weight_scale: shape \[\], expected \[64\]"):
        check_checkpoint(ckpt, "int8_sq", None)


def test_int4_group_scale_shape_follows_group_size(tmp_path):
    ckpt = make_checkpoint(tmp_path, "int4_awq", quant={"group_size": 64})
    # Sorted order: the first offender is layer 0's down_proj (mlp.* sorts before self_attn.*).
    expected = r"^model\.layers\.0\.mlp\.down_proj\.weight_scale: shape \[256, 4\], expected \[256, 8\]$"
    with pytest.raises(QuantCheckError, match=expected):
        check_checkpoint(ckpt, "int4_awq", None)


def test_w4a8_needs_weight_scale_2(tmp_path):
    tensors = layer_tensors("w4a8_awq", kv=False)
    del tensors["model.layers.0.mlp.gate_proj.weight_scale_2"]
    ckpt = make_checkpoint(tmp_path, "w4a8_awq", tensors=tensors)
    with pytest.raises(QuantCheckError, match=r"gate_proj\.weight_scale_2: missing"):
        check_checkpoint(ckpt, "w4a8_awq", None)


def test_int4_checkpoint_is_not_w4a8(tmp_path):
    with pytest.raises(QuantCheckError, match=r"quant_algo 'W4A16_AWQ', expected 'W4A8_AWQ'"):
        check_checkpoint(make_checkpoint(tmp_path, "int4_awq"), "w4a8_awq", None)


def test_excluded_modules_may_stay_unquantized(tmp_path):
    tensors = layer_tensors("fp8", kv=False)
    for suffix in ("weight_scale", "input_scale"):
        del tensors[f"model.layers.1.mlp.down_proj.{suffix}"]
    tensors["model.layers.1.mlp.down_proj.weight"] = ("BF16", (HIDDEN, INTER))
    ckpt = make_checkpoint(tmp_path, "fp8", tensors=tensors,
                           quant={"exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.*.mlp.down_proj"]})
    report = check_checkpoint(ckpt, "fp8", None)
    assert report.quantized_weights == LAYERS * len(PROJS) - LAYERS


def test_config_json_quantization_config_is_the_fallback(tmp_path):
    ckpt = make_checkpoint(tmp_path, "fp8")
    (ckpt / "hf_quant_config.json").unlink()
    assert check_checkpoint(ckpt, "fp8", None).quant_algo == "FP8"


def test_config_json_kv_cache_scheme_means_fp8_kv(tmp_path):
    ckpt = make_checkpoint(tmp_path, "fp8", kv=True)
    (ckpt / "hf_quant_config.json").unlink()
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert check_checkpoint(ckpt, "fp8", "fp8").kv_cache_quant_algo == "FP8"


def test_unquantized_checkpoint(tmp_path):
    report = check_checkpoint(make_checkpoint(tmp_path, "none"), "none", None)
    assert report.quant_algo is None and report.quantized_weights == 0
    with pytest.raises(QuantCheckError, match="quant_algo None, expected 'FP8'"):
        check_checkpoint(tmp_path, "fp8", None)


def test_quantized_checkpoint_is_not_none(tmp_path):
    with pytest.raises(QuantCheckError, match="format 'none' but the checkpoint carries a quantization config"):
        check_checkpoint(make_checkpoint(tmp_path, "int8_sq"), "none", None)


def test_sharded_checkpoint_via_index(tmp_path):
    tensors = layer_tensors("int4_awq", kv=False)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    tmp_path.mkdir(exist_ok=True)
    make_checkpoint(tmp_path, "int4_awq", tensors={})
    (tmp_path / "model.safetensors").unlink()
    for shard, keys in shards.items():
        write_safetensors(tmp_path / shard, {k: tensors[k] for k in keys})
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    report = check_checkpoint(tmp_path, "int4_awq", None)
    assert report.files == tuple(sorted(shards)) and report.tensors == len(tensors)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(QuantCheckError, match="missing shard model-00002-of-00002.safetensors"):
        check_checkpoint(tmp_path, "int4_awq", None)


def test_corrupt_header_and_empty_dir(tmp_path):
    with pytest.raises(QuantCheckError, match="no .safetensors files"):
        check_checkpoint(tmp_path, "fp8", None)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(struct.pack("<Q", 12) + b"{not json!!}")
    with pytest.raises(QuantCheckError, match="unreadable safetensors header"):
        read_safetensors_header(bad)
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(QuantCheckError, match="too short"):
        read_safetensors_header(bad)


def test_unknown_format_and_kv(tmp_path):
    ckpt = make_checkpoint(tmp_path, "fp8")
    with pytest.raises(QuantCheckError, match="unknown format 'nvfp4'"):
        check_checkpoint(ckpt, "nvfp4", None)
    with pytest.raises(QuantCheckError, match="unknown kv_cache_dtype 'fp4'"):
        check_checkpoint(ckpt, "fp8", "fp4")


def test_header_reader_matches_safetensors_library(tmp_path):
    """Our stdlib parser agrees with the reference implementation on a file it wrote."""
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "x.safetensors"
    st.save_file({"a": np.zeros((3, 5), dtype=np.float32), "b": np.ones((7,), dtype=np.int8)}, str(path))
    header = read_safetensors_header(path)
    assert {k: (v.dtype, v.shape) for k, v in header.items()} == {"a": ("F32", (3, 5)), "b": ("I8", (7,))}


def test_module_does_not_import_torch():
    code = "import sys, stoker.plan.quant_check; sys.exit(1 if 'torch' in sys.modules else 0)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
