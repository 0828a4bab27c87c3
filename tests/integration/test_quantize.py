"""Quantize the tiny Llama with the real modelopt worker, check the export, build the reference.

Each case runs `python -m stoker.workers.quantize` and `python -m stoker.workers.build_reference`
as real child processes. The proof that dequantization reads ModelOpt's layout correctly is
the comparison with ModelOpt's own fake-quantized weights, which the worker dumps from the
in-memory quantized model (request key `fake_quant_out`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.plan.quant_check import check_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "stoker" / "data" / "calibration.txt"
# Module -> the norm whose output feeds it. AWQ fuses pre_quant_scale into these norms, so the
# linear maps the network applies are norm_weight (per input column) times the projection.
NORM_OF = {"self_attn.q_proj": "input_layernorm", "self_attn.k_proj": "input_layernorm",
           "self_attn.v_proj": "input_layernorm", "mlp.gate_proj": "post_attention_layernorm",
           "mlp.up_proj": "post_attention_layernorm", "self_attn.o_proj": None, "mlp.down_proj": None}
# (format, kv) -> bounds on the relative Frobenius error of the dequantized linear maps vs the
# float model: non-zero (it really was quantized) and small (it was dequantized right).
CASES = {
    "fp8": ("fp8", None, (0.005, 0.06)),
    "fp8-kvfp8": ("fp8", "fp8", (0.005, 0.06)),
    "int8_sq": ("int8_sq", None, (0.001, 0.04)),
    "int4_awq": ("int4_awq", None, (0.05, 0.25)),
    "w4a8_awq": ("w4a8_awq", None, (0.05, 0.25)),
}

def run_worker(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # The suite's quantize memo off (stoker/workers/quantize.py): here the worker runs every time, or determinism
    # would compare a copy with itself.
    env = {**{k: v for k, v in os.environ.items() if k != "STOKER_QUANTIZE_MEMO"}, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env, check=False)


def sha256s(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from stoker.workers.tinymodel import make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(out, seed=0)
    return out


@pytest.fixture(scope="module")
def float_weights(tiny) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(tiny / "model.safetensors")).items()}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tiny, tmp_path_factory) -> dict:
    """Quantize + build once per case; the tests below inspect the results."""
    fmt, kv, bounds = CASES[request.param]
    work = tmp_path_factory.mktemp(request.param)
    req = {"checkpoint": str(tiny), "format": fmt, "kv_cache_dtype": kv,
           "calibration": {"text_file": str(CALIBRATION), "samples": 2, "seq_len": 64, "batch_size": 2},
           "seed": 0, "fake_quant_out": str(work / "fake_quant.safetensors")}
    (work / "request.json").write_text(json.dumps(req))
    started = time.monotonic()
    result = run_worker("stoker.workers.quantize", "--request", str(work / "request.json"), "--out", str(work / "q"))
    quantize_s = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    started = time.monotonic()
    built = run_worker("stoker.workers.build_reference", "--checkpoint", str(work / "q"), "--out", str(work / "ref"))
    build_s = time.monotonic() - started
    assert built.returncode == 0, built.stderr[-3000:]
    print(f"\n[{request.param}] quantize worker {quantize_s:.1f}s, build_reference {build_s:.1f}s")
    return {"name": request.param, "format": fmt, "kv": kv, "bounds": bounds, "work": work, "q": work / "q",
            "ref": work / "ref", "stdout": result.stdout, "stderr": result.stderr,
            "build_stdout": built.stdout}


def _norm_name(module: str) -> str | None:
    prefix, _, proj = module.rpartition(".")
    layer_prefix, _, kind = prefix.rpartition(".")
    norm = NORM_OF[f"{kind}.{proj}"]
    return f"{layer_prefix}.{norm}.weight" if norm else None


def _linear_map(weights: dict, module: str):
    """The projection as the network applies it to the residual stream (norm folded in)."""
    w = weights[f"{module}.weight"].float()
    norm = _norm_name(module)
    return w * weights[norm].float().reshape(1, -1) if norm else w


def _modules(weights: dict) -> list[str]:
    return sorted(k[: -len(".weight")] for k in weights if k.endswith("_proj.weight"))


@pytest.mark.slow
def test_worker_output_and_structure(case):
    info = json.loads((case["q"] / "stoker_quantize.json").read_text())
    assert info["format"] == case["format"] and info["kv_cache_dtype"] == case["kv"]
    assert info["modelopt_version"] == "0.47.0"
    expected_cfgs = {"fp8": "FP8_DEFAULT_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG", "int4_awq": "INT4_AWQ_CFG",
                     "w4a8_awq": "W4A8_AWQ_BETA_CFG"}[case["format"]]
    assert info["modelopt_configs"] == [expected_cfgs] + (["FP8_KV_CFG"] if case["kv"] else [])
    assert info["calibration"]["tokens_used"] == 2 * 64
    assert json.loads(case["stdout"].strip().splitlines()[-1])["format"] == case["format"]
    assert "quantize: mtq.quantize with" in case["stderr"]

    report = check_checkpoint(case["q"], case["format"], case["kv"])
    assert report.quantized_weights == 4 * 7
    assert report.kv_scaled_layers == (4 if case["kv"] else 0)
    config = json.loads((case["q"] / "config.json").read_text())
    assert config["dtype"] == "bfloat16", "export must record the checkpoint's dtype, not the calibration dtype"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (case["q"] / name).is_file(), name

    runtime = json.loads((case["ref"] / "stoker_runtime.json").read_text())
    assert runtime["format"] == "stoker-reference/1" and runtime["dtype"] == "float32"
    assert (runtime["end_id"], runtime["pad_id"]) == (2, 3)
    assert runtime["quantization"]["format"] == case["format"]
    assert runtime["quantization"]["kv_cache_dtype"] == case["kv"]
    scales = runtime["quantization"]["kv_scales"]
    if case["kv"]:
        assert sorted(scales) == ["0", "1", "2", "3"]
        assert all(0 < s["k"] < 1 and 0 < s["v"] < 1 for s in scales.values())
    else:
        assert scales == {}
    ref_config = json.loads((case["ref"] / "config.json").read_text())
    assert "quantization_config" not in ref_config and ref_config["dtype"] == "float32"


@pytest.mark.slow
def test_dequantized_weights_match_modelopt_fake_quant(case):
    """Same numbers as ModelOpt's quantizer forward on the weight: nibble order, groups, scales."""
    import torch
    from safetensors.torch import load_file

    ref = load_file(str(case["ref"] / "model.safetensors"))
    fake = load_file(str(case["work"] / "fake_quant.safetensors"))
    total = mismatched = 0
    worst = 0.0
    for key in sorted(k for k in fake if k.endswith(".weight")):
        module = key[: -len(".weight")]
        expected = fake[key]
        if f"{module}.pre_quant_scale" in fake:
            expected = expected * fake[f"{module}.pre_quant_scale"].reshape(1, -1)
        got = ref[key]
        assert got.dtype == torch.float32 and got.shape == expected.shape, key
        diff = (got - expected).abs()
        off = diff > 1e-5 * expected.abs().max()
        total += diff.numel()
        mismatched += int(off.sum())
        if off.any():
            worst = max(worst, float((diff[off] / expected[off].abs().clamp_min(1e-12)).max()))
    frac = mismatched / total
    print(f"\n[{case['name']}] vs fake-quant: {frac:.4%} of {total} weights differ, worst relative {worst:.3f}")
    if case["format"] == "fp8":
        # The exporter divides by the scale in bf16 before casting to FP8 (double rounding), so a
        # few percent of values land one FP8 step away; one E4M3 step is at most 1/8 relative.
        assert frac < 0.06 and worst <= 0.126
    else:
        # Integer grids (and w4a8's second FP8 stage): identical except rare round-half ties
        # between the exporter's arithmetic and the quantizer's.
        assert frac < 5e-4


@pytest.mark.slow
def test_dequantized_weights_close_to_float(case, float_weights):
    from safetensors.torch import load_file

    ref = load_file(str(case["ref"] / "model.safetensors"))
    assert set(ref) == set(float_weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert (ref[name] == float_weights[name]).all(), f"{name} is not quantized and must pass through exactly"
    errors = []
    for module in _modules(float_weights):
        a, b = _linear_map(ref, module), _linear_map(float_weights, module)
        errors.append(float((a - b).norm() / b.norm()))
    low, high = case["bounds"]
    mean = sum(errors) / len(errors)
    print(f"\n[{case['name']}] dequantized vs float: mean rel error {mean:.4f}, max {max(errors):.4f}")
    assert low < mean and max(errors) < high


@pytest.mark.slow
def test_reference_logits_close_to_float_model(case, tiny):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer(CALIBRATION.read_text()[:400], return_tensors="pt")["input_ids"][:, :48]
    with torch.no_grad():
        base = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()(ids).logits
        deq = LlamaForCausalLM.from_pretrained(case["ref"], dtype=torch.float32).eval()(ids).logits
    rel = float((deq - base).norm() / base.norm())
    agree = float((deq.argmax(-1) == base.argmax(-1)).float().mean())
    print(f"\n[{case['name']}] logits rel diff {rel:.4f}, top-1 agreement {agree:.2%}")
    assert 1e-4 < rel < case["bounds"][1] * 2


# The reruns below cost a quantization or a build each: run where the code path differs, not for every case —
# the build step is one code path for every format; quantization's are modelopt's per-tensor fp8 and its AWQ search.
DETERMINISM_CASES = ("fp8", "int4_awq")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["int4_awq"], indirect=True)  # the build step is one code path for every format
def test_reference_build_is_deterministic(case, tmp_path):
    again = run_worker("stoker.workers.build_reference", "--checkpoint", str(case["q"]), "--out", str(tmp_path / "ref"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert sha256s(tmp_path / "ref") == sha256s(case["ref"])
    assert json.loads(again.stdout.strip().splitlines()[-1])["files"] == sha256s(case["ref"])


@pytest.mark.slow
@pytest.mark.parametrize("case", DETERMINISM_CASES, indirect=True)
def test_quantize_is_deterministic_and_dump_changes_nothing(case, tmp_path):
    """A rerun without `fake_quant_out` (the production path) writes the same bytes."""
    req = json.loads((case["work"] / "request.json").read_text())
    del req["fake_quant_out"]
    (tmp_path / "request.json").write_text(json.dumps(req))
    again = run_worker("stoker.workers.quantize", "--request", str(tmp_path / "request.json"),
                       "--out", str(tmp_path / "q"))
    assert again.returncode == 0, again.stderr[-2000:]
    first, second = sha256s(case["q"]), sha256s(tmp_path / "q")
    # stoker_quantize.json records durations; everything else must be identical.
    assert first.pop("stoker_quantize.json") and second.pop("stoker_quantize.json")
    assert first == second


@pytest.mark.slow
def test_unquantized_reference_is_exact(tiny, float_weights, tmp_path):
    from safetensors.torch import load_file

    built = run_worker("stoker.workers.build_reference", "--checkpoint", str(tiny), "--out", str(tmp_path / "ref"))
    assert built.returncode == 0, built.stderr[-2000:]
    ref = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(ref) == set(float_weights) and all((ref[k] == float_weights[k]).all() for k in ref)
    runtime = json.loads((tmp_path / "ref" / "stoker_runtime.json").read_text())
    assert runtime["quantization"] == {"format": "none", "kv_cache_dtype": None, "kv_scales": {}}


@pytest.mark.parametrize("patch, cause", [
    ({"format": "none"}, "format 'none' needs no quantization"),
    ({"kv_cache_dtype": "int8"}, "kv_cache_dtype 'int8' cannot be exported"),
    ({"format": "nvfp4"}, "format 'nvfp4' not supported"),
    ({"calibration": {"text_file": "/nonexistent.txt", "samples": 1, "seq_len": 8, "batch_size": 1}},
     "calibration text_file /nonexistent.txt not found"),
])
def test_quantize_worker_refuses_bad_requests(tmp_path, patch, cause):
    """Refused before any heavy import: exit 1, one-line cause last on stderr, nothing written."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    req = {"checkpoint": str(tmp_path / "ckpt"), "format": "fp8", "kv_cache_dtype": None,
           "calibration": {"text_file": str(CALIBRATION), "samples": 1, "seq_len": 8, "batch_size": 1},
           "seed": 0} | patch
    (tmp_path / "req.json").write_text(json.dumps(req))
    result = run_worker("stoker.workers.quantize", "--request", str(tmp_path / "req.json"),
                        "--out", str(tmp_path / "q"))
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and cause in last
    assert result.stdout == "" and not (tmp_path / "q").exists()


def test_calibration_windows_are_deterministic_and_wrap():
    from stoker.workers.quantize import calibration_ids

    ids = list(range(10, 17))
    assert calibration_ids(ids, 3, 4, bos_id=1) == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 10, 11]]
    assert calibration_ids(ids, 2, 3, bos_id=None) == [[10, 11, 12], [13, 14, 15]]
