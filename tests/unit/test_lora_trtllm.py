"""LoRA adapters converted to TensorRT-LLM's format (the engine target's package step), against PEFT: the rows are
laid out as TensorRT-LLM's converter lays them, and the reference runtime serving the converted files (what the
stand-in does with an engine repository) answers exactly what transformers + PEFT answer, for every architecture."""

from __future__ import annotations

import json

import numpy as np
import pytest

peft = pytest.importorskip("peft")

from safetensors.numpy import load_file
from test_batching import ARCHS
from test_lora import make_adapter, peft_model
from test_runtime import CONFIGS, NO_END, PROMPT, hf_greedy, hf_model, write_artifact

from stoker.gpu import lora as gpu_lora
from stoker.runtime.generate import generate
from stoker.runtime.lora_config import LINEAR_MODULES, AdapterError, read_config
from stoker.runtime.lora_trtllm import CONFIG_NPY, MODULE_IDS, WEIGHTS_NPY, to_trtllm
from stoker.runtime.model import load_model


def _described(folders: dict) -> dict:
    return {name: {"task_id": 100 + i} for i, name in enumerate(sorted(folders))}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_converted_adapters_served_by_the_runtime_equal_peft(arch, tmp_path):
    CONFIGS.setdefault(arch, ARCHS[arch])
    base = hf_model(arch)
    folders = {"a1": make_adapter(base, tmp_path / "a1", 1),
               "a2": make_adapter(base, tmp_path / "a2", 2, r=8, rslora=True, targets=LINEAR_MODULES[arch][-2:])}
    described = _described(folders)
    converted = gpu_lora.convert_all(tmp_path, described, tmp_path / "lora", dtype="float32")
    assert {n: c["task_id"] for n, c in converted.items()} == {"a1": 100, "a2": 101}
    model = load_model(write_artifact(base, tmp_path / "artifact"), num_threads=2, trtllm_adapters={
        name: tmp_path / "lora" / str(d["task_id"]) for name, d in described.items()})
    want_base = hf_greedy(base, PROMPT, 16)
    assert list(generate(model, PROMPT, 16, NO_END)) == want_base
    for name, folder in folders.items():
        want = hf_greedy(peft_model(base, folder), PROMPT, 16)
        assert want != want_base  # the adapter changes the answer
        assert list(generate(model, PROMPT, 16, NO_END, adapter=name)) == want, name


def test_rows_are_tensorrt_llms_layout_a_then_scaled_b_and_a_fused_gate_up_is_swapped(tmp_path):
    base = hf_model("llama")
    folder = make_adapter(base, tmp_path / "a", 3, r=4)
    cfg = read_config(folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    weights, config = to_trtllm(tensors, cfg, "float16")
    assert weights.dtype == np.float16 and config.dtype == np.int32 and config.shape == (1, weights.shape[1], 3)
    layers = base.config.num_hidden_layers
    assert config.shape[1] == layers * 7  # every linear of every layer
    assert config[0, 0].tolist() == [MODULE_IDS["attn_q"], 0, 4]  # sorted by layer, then TensorRT-LLM's module id
    assert sorted({int(m) for m in config[0, :, 0]}) == sorted(MODULE_IDS[m] for m in gpu_lora.engine_modules("llama"))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
    want = np.concatenate([a.ravel(), (b * cfg.scaling).ravel()]).astype(np.float16)
    assert np.array_equal(weights[0, 0, :want.size], want)
    assert not weights[0, 0, want.size:].any()  # the padding up to the widest row

    CONFIGS.setdefault("phi3", ARCHS["phi3"])
    phi = hf_model("phi3")
    folder = make_adapter(phi, tmp_path / "p", 1, r=2, targets=["gate_up_proj"])
    cfg = read_config(folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    weights, config = to_trtllm(tensors, cfg, "float32")
    b = tensors["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"] * cfg.scaling
    half = b.shape[0] // 2
    a_size = tensors["base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight"].size
    row = weights[0, 0, a_size:a_size + b.size].reshape(b.shape)
    assert config[0, 0].tolist() == [MODULE_IDS["mlp_h_to_4h"], 0, 2]
    assert np.array_equal(row[:half], b[half:]) and np.array_equal(row[half:], b[:half])  # up first, then gate


def test_the_build_flags_and_the_cache_hold_every_adapter():
    from stoker.spec.load import parse_spec

    spec = parse_spec({"model": {"repo_id": "org/base"}, "storage": {"bucket": "bkt"}, "target": "tensorrt",
                       "gpus": {"type": "h100-80gb", "count": 1}, "lora": {"max_rank": 16},
                       "adapters": [{"name": "support", "repo_id": "org/support-lora"}]})
    assert gpu_lora.build_flags(spec, "llama") == [
        "--lora_plugin", "float16", "--max_lora_rank", "16", "--lora_target_modules", "attn_q", "attn_k", "attn_v",
        "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]
    assert gpu_lora.build_flags(spec, "phi3")[-4:] == ["attn_qkv", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h"]
    assert gpu_lora.build_flags(spec.model_copy(update={"adapters": []}), "llama") == []
    converted = {"a": {"rank": 8, "bytes": 3 << 30}, "b": {"rank": 4, "bytes": 1 << 20}}
    params = gpu_lora.cache_parameters(converted, 16, 81559, "/models/tensorrt_llm/1/lora")
    assert params["lora_prefetch_dir"] == "/models/tensorrt_llm/1/lora"
    assert params["lora_cache_optimal_adapter_size"] == "8" and params["lora_cache_max_adapter_size"] == "16"
    assert int(params["lora_cache_host_memory_bytes"]) >= 2 * ((3 << 30) + (1 << 20))
    assert 0.05 < float(params["lora_cache_gpu_memory_fraction"]) <= 0.5  # 6 GiB of a tenth of 80 GiB
    small = gpu_lora.cache_parameters({"a": {"rank": 4, "bytes": 1 << 20}}, 16, 81559, "/x")
    assert small["lora_cache_gpu_memory_fraction"] == "0.05" and small["lora_cache_host_memory_bytes"] == str(1 << 30)


def test_a_module_tensorrt_llm_has_no_id_for_is_refused(tmp_path):
    base = hf_model("llama")
    folder = make_adapter(base, tmp_path / "a", 1, targets=["q_proj"])
    tensors = dict(load_file(str(folder / "adapter_model.safetensors")))
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 8), np.float32)
    tensors["base_model.model.lm_head.lora_B.weight"] = np.zeros((8, 4), np.float32)
    with pytest.raises(AdapterError, match="lm_head: TensorRT-LLM's LoRA has no module for it"):
        to_trtllm(tensors, read_config(folder), "float16")
    # the files a converted folder holds, as TensorRT-LLM's prefetch reads them
    gpu_lora.convert_all(tmp_path, {"a": {"task_id": 7}}, tmp_path / "lora")
    assert sorted(p.name for p in (tmp_path / "lora" / "7").iterdir()) == sorted([WEIGHTS_NPY, CONFIG_NPY])
    assert np.load(tmp_path / "lora" / "7" / WEIGHTS_NPY).dtype == np.float16
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
