"""Plan-time model checks: shapes, KV heads and architectures refused from config.json alone, in one line."""

from __future__ import annotations

import pytest

from stoker.plan import model_checks
from stoker.gpu import decoders, rules
from stoker.gpu.facts import from_config
from stoker.gpu.rules import PlanRefused
from stoker.spec.load import parse_spec

CURRENT = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2048,
         "max_position_embeddings": 2048, "eos_token_id": 2}


def facts(**over):
    return from_config({**LLAMA, **over})


def spec(target="reference", fmt="int4_awq", tensor=1):
    data = {"model": {"repo_id": "org/m"}, "storage": {"bucket": "bkt"}, "target": target,
            "quantization": {"format": fmt}}
    if target != "reference":
        data |= {"gpus": {"type": "h100-80gb", "count": 8}, "deploy": {"image": CURRENT},
                 "parallel": {"tensor": tensor}}
    return parse_spec(data)


def refused(s, f) -> str:
    with pytest.raises(PlanRefused) as err:
        model_checks.enforce(s, f)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_plain_llama_passes_every_format():
    for fmt in ("none", "fp8", "int4_awq", "int8_sq", "w4a8_awq"):
        model_checks.enforce(spec(fmt=fmt), facts())


def test_hidden_size_not_a_multiple_of_the_awq_block():
    text = refused(spec(fmt="int4_awq"), facts(hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                                               intermediate_size=512))
    assert text == ("quantization.format int4_awq: hidden_size 192 is not a multiple of the AWQ block size 128; "
                    "use fp8 or int8_sq")


def test_intermediate_size_is_down_projs_input():
    text = refused(spec(fmt="w4a8_awq"), facts(intermediate_size=688))
    assert text.startswith("quantization.format w4a8_awq: intermediate_size 688 is not a multiple of the AWQ block")


def test_o_proj_input_is_heads_times_head_dim():
    # head_dim 48 × 8 heads = 384: a multiple; head_dim 40 × 8 = 320 is not, although hidden 256 is.
    model_checks.enforce(spec(fmt="int4_awq"), facts(head_dim=48))
    text = refused(spec(fmt="int4_awq"), facts(head_dim=40))
    assert "num_attention_heads x head_dim 320 is not a multiple of the AWQ block size 128" in text


def test_fp8_and_int8_sq_need_no_block():
    f = facts(hidden_size=192, num_attention_heads=6)
    for fmt in ("fp8", "int8_sq", "none"):
        model_checks.enforce(spec(fmt=fmt), f)


def test_gpu_alternatives_follow_the_target_and_gpu():
    f = facts(hidden_size=192, num_attention_heads=6)
    assert model_checks.block_refusal("int4_awq", f, "pytorch")[1].endswith("use fp8 or fp8_pc_pt")
    # An A100 (SM 8.0) cannot run fp8: the fix names what it can.
    assert model_checks.block_refusal("int4_awq", f, "tensorrt", gpu_sm=80)[1].endswith("use int8_sq or int8_wo")
    assert model_checks.block_refusal("nvfp4", facts(hidden_size=200, num_attention_heads=8, head_dim=32),
                                      "tensorrt")[1].startswith("hidden_size 200 is not a multiple of the NVFP4 block size 16")


@pytest.mark.parametrize("arch,model_type", [("Qwen2ForCausalLM", "qwen2"), ("MistralForCausalLM", "mistral"),
                                             ("Phi3ForCausalLM", "phi3"), ("LlamaForCausalLM", "llama")])
@pytest.mark.parametrize("fmt", ["none", "fp8", "int4_awq"])
def test_reference_target_serves_the_architectures_it_was_matched_on(arch, model_type, fmt):
    model_checks.enforce(spec(fmt=fmt), facts(architectures=[arch], model_type=model_type))


@pytest.mark.parametrize("arch,model_type", [("GemmaForCausalLM", "gemma"), ("Qwen3MoeForCausalLM", "qwen3_moe")])
def test_reference_target_refuses_other_architectures_in_one_line(arch, model_type):
    text = refused(spec(fmt="none"), facts(architectures=[arch], model_type=model_type))
    assert text == (f"target reference: architecture {arch} is not served by the reference runtime (LlamaForCausalLM, "
                    "Qwen2ForCausalLM, MistralForCausalLM, Phi3ForCausalLM); use target: pytorch on a GPU host")


@pytest.mark.parametrize("over", [{"attention_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"},
                                  {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                  {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}])
def test_reference_serves_llama_variants_through_transformers(over):
    """transformers' own LlamaForCausalLM computes biases, activations and rope variants: nothing to refuse."""
    model_checks.enforce(spec(fmt="fp8"), facts(**over))


@pytest.mark.parametrize("fmt", ["none", "fp8", "int4_awq"])
@pytest.mark.parametrize("arch,model_type,decoder", [("LlamaForCausalLM", "llama", "llama"),
                                                     ("Qwen2ForCausalLM", "qwen2", "qwen"),
                                                     ("MistralForCausalLM", "mistral", "llama"),
                                                     ("MixtralForCausalLM", "mixtral", "llama"),
                                                     ("GemmaForCausalLM", "gemma", "gemma")])
def test_engine_target_takes_what_modelopt_exports_under_tensorrt_llms_decoder_names(arch, model_type, decoder, fmt):
    assert decoders.decoder_type(arch) == decoder
    model_checks.enforce(spec("tensorrt", fmt), facts(architectures=[arch], model_type=model_type))


@pytest.mark.parametrize("arch,model_type", [("Phi3ForCausalLM", "phi3"), ("Gemma2ForCausalLM", "gemma2"),
                                             ("Qwen3ForCausalLM", "qwen3"), ("GPTNeoXForCausalLM", "gpt_neox")])
def test_engine_target_refuses_what_the_exporter_cannot_take_in_one_line(arch, model_type):
    text = refused(spec("tensorrt", "fp8"), facts(architectures=[arch], model_type=model_type))
    if arch.startswith("Phi3"):
        assert text == ("target tensorrt: architecture Phi3ForCausalLM cannot be exported to a TensorRT-LLM "
                        "checkpoint: ModelOpt 0.47's legacy exporter refuses Phi-3 as phi3/phi and writes a malformed "
                        "one as llama/gpt; use target: pytorch (the unified HF checkpoint)")
    else:
        assert text == (f"target tensorrt: architecture {arch} has no decoder in ModelOpt's legacy TensorRT-LLM "
                        f"export ({decoders.MAPPED}); use target: pytorch")
    model_checks.enforce(spec("pytorch", "fp8"), facts(architectures=[arch], model_type=model_type))


def test_tensor_parallelism_must_split_or_replicate_kv_heads():
    f = facts(num_attention_heads=12, num_key_value_heads=3, hidden_size=384, head_dim=32)
    model_checks.enforce(spec("tensorrt", "fp8", tensor=3), f)  # 1 KV head per rank
    model_checks.enforce(spec("tensorrt", "fp8", tensor=6), f)  # each KV head on two ranks
    text = refused(spec("tensorrt", "fp8", tensor=4), facts(num_attention_heads=8, num_key_value_heads=6,
                                                          head_dim=32))
    assert text == ("parallel.tensor: 4 neither divides the model's 6 KV heads nor is a multiple of them; "
                    "use one of 1, 2")


def test_gpu_plan_rules_carry_the_model_refusals():
    f = facts(hidden_size=192, num_attention_heads=6)
    found = [x for x in rules.check(spec("tensorrt", "int4_awq"), f, True) if x.level == "refuse"]
    assert [x.line() for x in found] == ["quantization.format int4_awq: hidden_size 192 is not a multiple of the "
                                         "AWQ block size 128; use fp8 or fp8_pc_pt"]


def test_no_facts_no_model_refusals():
    assert model_checks.refusals(spec(), None) == []


def test_plan_reads_the_local_checkpoints_config_before_any_download(tmp_path):
    import json

    from stoker.plan.compose import check_model

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "architectures": ["GemmaForCausalLM"],
                                                      "model_type": "gemma"}))
    s = parse_spec({"model": {"local_path": str(tmp_path)}, "storage": {"bucket": "bkt"}})
    with pytest.raises(PlanRefused, match="^target reference: architecture GemmaForCausalLM "):
        check_model(s)
