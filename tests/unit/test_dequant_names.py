"""Dequantization goes by tensor name, not by architecture: biases pass through, fused projections dequantize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file

from stoker.runtime.dequant import load_dequantized


def test_fp8_biases_fused_projections_and_kv_scales(tmp_path: Path) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(48, 16)  # Phi-3's fused q/k/v projection
    q = torch.randn(32, 16)  # Qwen2's q_proj, which carries a bias
    bias = torch.randn(32)
    scale = torch.tensor(0.01)
    p = "model.layers.0.self_attn."
    save_file({
        p + "qkv_proj.weight": (qkv / scale).to(torch.float8_e4m3fn), p + "qkv_proj.weight_scale": scale.clone(),
        p + "qkv_proj.input_scale": torch.tensor(0.5),
        p + "q_proj.weight": (q / scale).to(torch.float8_e4m3fn), p + "q_proj.weight_scale": scale,
        p + "q_proj.bias": bias,
        # ModelOpt names K/V scales after k_proj/v_proj even when the model fuses them.
        p + "k_proj.k_scale": torch.tensor(0.25), p + "v_proj.v_scale": torch.tensor(0.125),
    }, str(tmp_path / "model.safetensors"))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))

    state, kv = load_dequantized(tmp_path)
    assert sorted(state) == [p + "q_proj.bias", p + "q_proj.weight", p + "qkv_proj.weight"]
    assert torch.equal(state[p + "q_proj.bias"], bias)  # not quantized: exactly as exported
    for name, original in ((p + "qkv_proj.weight", qkv), (p + "q_proj.weight", q)):
        assert state[name].dtype == torch.float32 and state[name].shape == original.shape
        assert ((state[name] - original).norm() / original.norm()).item() < 0.05  # FP8's rounding, no more
    assert kv == {0: {"k": 0.25, "v": 0.125}}
