"""GPU rules: `stoker plan` refuses, with one line naming the fix, before any GPU time."""

from __future__ import annotations

import json

import pytest

from stoker.gpu import matrix, rules
from stoker.gpu.facts import known
from stoker.gpu.rules import PlanRefused
from stoker.spec.load import parse_spec

CURRENT = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
LLAMA = known("meta-llama/Meta-Llama-3-8B-Instruct")


def gpu_spec(**over) -> object:
    data = {"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
            "target": "tensorrt", "gpus": {"type": "h100-80gb", "count": 1}, "deploy": {"image": CURRENT}}
    for k, v in over.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    return parse_spec(data)


def refusal(spec, facts=LLAMA, token=True) -> str:
    with pytest.raises(PlanRefused) as err:
        rules.enforce(rules.check(spec, facts, token))
    text = str(err.value)
    assert "\n" not in text
    return text


def test_a_good_spec_passes_with_notes():
    notes = rules.enforce(rules.check(gpu_spec(quantization={"format": "fp8"}), LLAMA, True))
    assert all(n.level == "note" for n in notes)
    assert any(n.field == "memory" for n in notes)


@pytest.mark.parametrize("tag", ["24.04", "24.05", "24.06", "24.07", "24.08", "24.09"])
def test_seed_images_are_refused_naming_the_supported_image(tag):
    text = refusal(gpu_spec(deploy={"image": f"nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3"}))
    assert text.startswith("deploy.image: ") and f"use {CURRENT}" in text
    assert matrix.image_info(f"nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3").trtllm in text


@pytest.mark.parametrize("target", ["tensorrt", "pytorch"])
def test_the_cpu_image_is_refused_for_both_gpu_targets_naming_nvidias_image(target):
    # It carries no TensorRT-LLM at all: "use target: pytorch" (once said for the engine target) would fail again.
    text = refusal(gpu_spec(target=target, deploy={"image": "stoker/triton-cpu:2.51.0-cpu"}))
    assert text == ("deploy.image: stoker/triton-cpu:2.51.0-cpu carries no TensorRT-LLM (it serves target reference): "
                    f"target {target} needs NVIDIA's serving image, such as {CURRENT}")


def test_a_pytorch_spec_that_cannot_stream_is_refused_before_any_download():
    from stoker import targets

    spec = gpu_spec(target="pytorch", runtime={"decoupled": False})
    with pytest.raises(PlanRefused, match=r"^runtime.decoupled: false with target pytorch: .*stream"):
        targets.get("pytorch").check_model(spec, LLAMA)


@pytest.mark.parametrize("decoupled", [True, False])
def test_the_llmapi_config_declares_what_ranks_without_auto_complete_need(decoupled):
    # TP x PP > 1: every rank runs with --disable-auto-complete-config, so config.pbtxt alone decides `decoupled`.
    from stoker.gpu import llmapi, trtllm
    from stoker.containers.ports import Ports

    spec = gpu_spec(target="pytorch", gpus={"count": 2}, parallel={"tensor": 2}, runtime={"decoupled": decoupled})
    argv = trtllm.serve_command(spec, Ports(8000, 8001, 8002), [])
    assert argv.count("--disable-auto-complete-config") == 2
    cfg = llmapi.config(spec)
    assert cfg.model_transaction_policy.decoupled is decoupled and cfg.max_batch_size == 0
    assert llmapi.model_yaml(spec, 8192)["triton_config"]["decoupled"] is decoupled  # the same value for auto-complete


def test_the_12_line_is_the_last_with_the_engine_backend():
    assert matrix.has_engine_backend("1.2.1") and matrix.has_engine_backend("1.0.3.2510")
    assert not matrix.has_engine_backend("1.3.0rc2") and not matrix.has_engine_backend("2.0.0")


def test_an_image_after_the_12_line_refuses_the_engine_target_and_serves_pytorch(monkeypatch):
    later = json.loads(json.dumps(matrix.data()))
    later["images"]["26.10"] = {**later["images"]["26.07"], "trtllm": "1.3.0"}
    monkeypatch.setattr(matrix, "data", lambda: later)
    image = "nvcr.io/nvidia/tritonserver:26.10-trtllm-python-py3"
    info = matrix.image_info(image)
    assert not info.trtllm_build and info.targets == ("pytorch",)
    text = refusal(gpu_spec(deploy={"image": image}))
    assert text.startswith(f"deploy.image: {image} carries TRT-LLM 1.3.0, which has no trtllm-build") \
        and "use target: pytorch" in text
    assert not any(f.field == "deploy.image" for f in rules.check(gpu_spec(target="pytorch", deploy={"image": image}),
                                                                   LLAMA, True) if f.level == "refuse")


def test_unknown_image_is_refused():
    assert "not in stoker's version matrix" in refusal(gpu_spec(deploy={"image": "vllm/vllm-openai:latest"}))


def test_engine_built_by_one_trtllm_served_by_another(tmp_path):
    text = refusal(gpu_spec(build={"image": "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"}))
    assert text.startswith("build.image: the engine would be built by TRT-LLM 1.1.0 and served by TRT-LLM 1.2.1")
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"version": "0.11.0"}))
    text = refusal(gpu_spec(build={"engine_dir": str(engine)}))
    assert text.startswith("build.engine_dir: engine built by TRT-LLM 0.11.0 cannot be served by TRT-LLM 1.2.1")
    # the same TRT-LLM in another 1.2.1 image is fine
    rules.enforce(rules.check(gpu_spec(build={"image": "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"}),
                              LLAMA, True))


@pytest.mark.parametrize("gpu, fmt, kv, fragment", [
    ("a100-80gb", "fp8", "none", "quantization.format: 'fp8' needs compute capability >= 8.9; the NVIDIA A100 80GB has 8.0"),
    ("h100-80gb", "nvfp4", "none", "quantization.format: 'nvfp4' needs compute capability >= 10.0; the NVIDIA H100 80GB has 9.0"),
    ("a100-40gb", "int4_awq", "fp8", "quantization.kv_cache_dtype: 'fp8' KV cache needs compute capability >= 8.9"),
    ("a10g", "w4a8_awq", "none", "quantization.format: 'w4a8_awq' needs compute capability >= 8.9"),
])
def test_formats_the_gpu_cannot_run(gpu, fmt, kv, fragment):
    assert refusal(gpu_spec(gpus={"type": gpu, "count": 1}, quantization={"format": fmt, "kv_cache_dtype": kv})
                   ).startswith(fragment)


def test_blackwell_runs_nvfp4():
    rules.enforce(rules.check(gpu_spec(gpus={"type": "b200", "count": 1}, quantization={"format": "nvfp4"}), LLAMA, True))


def test_tp_times_pp_beyond_the_gpus():
    text = refusal(gpu_spec(gpus={"type": "h100-80gb", "count": 2}, parallel={"tensor": 2, "pipeline": 2}))
    assert text.startswith("parallel: tensor x pipeline = 4 needs 4 GPUs but gpus.count is 2")


def test_max_seq_len_beyond_context_needs_opt_in():
    text = refusal(gpu_spec(build={"max_seq_len": 16384}))
    assert text.startswith("build.max_seq_len: 16384 exceeds the model's context of 8192 tokens")
    assert "allow_long_context" in text
    rules.enforce(rules.check(gpu_spec(build={"max_seq_len": 16384, "allow_long_context": True}), LLAMA, True))


def test_gated_repo_without_token():
    text = refusal(gpu_spec(), token=False)
    assert text == ("model.repo_id: meta-llama/Meta-Llama-3-8B-Instruct is gated and no Hub token is set: "
                    "put a token with access in $HF_TOKEN")


def test_weights_that_do_not_fit_the_gpu():
    from stoker.gpu.facts import from_config

    big = from_config({"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                       "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
                       "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}, gated=False)
    text = refusal(gpu_spec(), facts=big)
    assert text.startswith("gpus.type: ~") and "NVIDIA H100 80GB" in text and "int4_awq" in text
    # INT4 AWQ fits one H100; so does 16-bit over two with TP2
    rules.enforce(rules.check(gpu_spec(quantization={"format": "int4_awq"}), big, True))
    rules.enforce(rules.check(gpu_spec(gpus={"type": "h100-80gb", "count": 2}, parallel={"tensor": 2}), big, True))
    # the infracloud seed: Llama 3 8B INT4 AWQ on an L4
    rules.enforce(rules.check(gpu_spec(gpus={"type": "l4", "count": 1}, quantization={"format": "int4_awq"}),
                              LLAMA, True))


def test_llmapi_target_refuses_what_its_checkpoint_cannot_carry():
    text = refusal(gpu_spec(target="pytorch", quantization={"format": "fp8", "kv_cache_dtype": "int8"}))
    assert text.startswith("quantization.kv_cache_dtype: 'int8' cannot be exported")
    assert refusal(gpu_spec(target="pytorch", quantization={"format": "int8_sq"})).startswith(
        "quantization.format: 'int8_sq' is not served by target 'pytorch'")


def test_memory_estimate_arithmetic():
    est = rules.estimate_memory(gpu_spec(), LLAMA, matrix.gpu_info("h100-80gb"))
    # Llama 3 8B: 8.03e9 params in 16 bit; KV per token = 2 * 32 layers * 8 heads * 128 * 2 bytes
    assert LLAMA.params == 8_030_261_248
    assert est.weights_per_gpu == 2 * LLAMA.params
    assert est.kv_bytes_per_token_per_gpu == 131072
    tp2 = rules.estimate_memory(gpu_spec(gpus={"type": "h100-80gb", "count": 2}, parallel={"tensor": 2}),
                                LLAMA, matrix.gpu_info("h100-80gb"))
    assert tp2.weights_per_gpu == LLAMA.params and tp2.kv_bytes_per_token_per_gpu == 65536
    fp8 = rules.estimate_memory(gpu_spec(quantization={"format": "fp8", "kv_cache_dtype": "fp8"}), LLAMA,
                                matrix.gpu_info("h100-80gb"))
    assert fp8.weights_per_gpu == (LLAMA.params - LLAMA.embedding_params) + 2 * LLAMA.embedding_params
    assert fp8.kv_bytes_per_token_per_gpu == 65536


def test_a_pytorch_spec_with_engine_only_build_fields_is_refused_in_one_line():
    text = refusal(gpu_spec(target="pytorch", build={"gemm_plugin": "fp8", "gather_context_logits": True}))
    assert text == ("build: build.gather_context_logits, build.gemm_plugin: trtllm-build settings, for the engine "
                    "target only; remove them for target pytorch")
    # The lengths and batch limits are the LLM API's too.
    rules.enforce(rules.check(gpu_spec(target="pytorch", build={"max_batch_size": 64, "max_num_tokens": 4096}),
                              LLAMA, True))


@pytest.mark.parametrize("fmt,gpu,expect", [
    ("nvfp4", "h100-80gb", "quantization.format: 'nvfp4' on the PyTorch backend needs compute capability >= 10.0; "
                           "the NVIDIA H100 80GB has 9.0: use one of none, fp8, fp8_pc_pt, int4_awq, w4a8_awq or a "
                           "newer GPU"),
    ("w4a8_awq", "b200", "quantization.format: 'w4a8_awq' on the PyTorch backend runs on compute capability 8.9–9.0 "
                         "only; the NVIDIA B200 has 10.0: use one of none, fp8, fp8_pc_pt, int4_awq, nvfp4"),
    ("fp8", "a100-80gb", "quantization.format: 'fp8' on the PyTorch backend needs compute capability >= 8.9; the "
                         "NVIDIA A100 80GB has 8.0: use one of none, int4_awq or a newer GPU"),
])
def test_the_pytorch_backend_refuses_a_format_its_gpu_cannot_run(fmt, gpu, expect):
    assert refusal(gpu_spec(target="pytorch", quantization={"format": fmt}, gpus={"type": gpu})) == expect


def test_int4_awq_needs_ampere_on_pytorch_not_on_the_engine():
    assert _runs_on("pytorch", "int4_awq", 75) is False and _runs_on("tensorrt", "int4_awq", 75) is True


def _runs_on(target: str, fmt: str, sm: int) -> bool:
    return rules._runs(fmt, target, sm)


def test_a_shared_rollouts_kv_budget_reaches_the_llm_apis_kv_cache_config():
    from stoker.gpu import llmapi

    spec = gpu_spec(target="pytorch", runtime={"max_tokens_in_paged_kv_cache": 12345})
    doc = llmapi.model_yaml(spec, 8192)
    assert doc["kv_cache_config"]["max_tokens"] == 12345 and doc["max_seq_len"] == 8192
    assert "max_tokens" not in llmapi.model_yaml(gpu_spec(target="pytorch"), None)["kv_cache_config"]
