"""Command rendering (exact output), cache keys, the version matrix, model facts."""

from __future__ import annotations

from pathlib import Path

from stoker.gpu import matrix, trtllm
from stoker.gpu.facts import choose_end_id, from_config, known
from stoker.cache import keys
from stoker.spec.load import load_spec

SPECS = Path(__file__).resolve().parents[2] / "deployments" / "specs"
LLAMA = known("meta-llama/Meta-Llama-3-8B-Instruct")


def gpu_build_key(spec, weights: str) -> str:
    return keys.gpu_build_key(spec, weights, trtllm.step_argvs(spec))  # as the build task computes it


def test_modal_seed_build_command_exactly():
    spec = load_spec(SPECS / "llama3-8b-fp16-a100-40gb-modal.yaml")
    assert trtllm.build_argv(spec, LLAMA) == [
        "trtllm-build", "--checkpoint_dir", "/workspace/trtllm_checkpoint", "--output_dir", "/workspace/engine",
        "--max_batch_size", "128", "--max_input_len", "256", "--max_seq_len", "512", "--max_num_tokens", "32768",
        "--max_beam_width", "1", "--kv_cache_type", "paged", "--tokens_per_block", "32",
        "--gpt_attention_plugin", "auto", "--gemm_plugin", "auto", "--remove_input_padding", "enable",
        "--context_fmha", "enable", "--use_paged_context_fmha", "enable", "--use_fp8_context_fmha", "disable",
        "--multiple_profiles", "disable", "--workers", "1",
        "--input_timing_cache", "/workspace/timing/sm80-trtllm1.2.1.cache",
        "--output_timing_cache", "/workspace/timing/sm80-trtllm1.2.1.cache", "--log_level", "info"]
    assert trtllm.quantize_argv(spec, LLAMA) == [
        "python3", "-m", "stoker.gpu.quantize_worker", "--model", "/workspace/hf", "--format", "none",
        "--kv-cache-dtype", "none", "--dtype", "float16", "--calib-file", "/workspace/calibration.txt",
        "--calib-size", "16", "--calib-seq-len", "128", "--calib-batch-size", "4", "--seed", "0",
        "--trtllm-out", "/workspace/trtllm_checkpoint", "--tp", "1", "--pp", "1"]


def test_build_key_covers_weights_quant_build_image_and_gpu_arch():
    base = load_spec(SPECS / "llama3-8b-fp8-h100-engine.yaml")
    k = gpu_build_key(base, "w" * 64)
    variants = [
        base.model_copy(update={"build": base.build.model_copy(update={"max_batch_size": 128})}),
        base.model_copy(update={"quantization": base.quantization.model_copy(update={"kv_cache_dtype": "none"})}),
        base.model_copy(update={"deploy": base.deploy.model_copy(update={"image_digest": "sha256:" + "a" * 64})}),
        base.model_copy(update={"gpus": base.gpus.model_copy(update={"type": "l40s"})}),
    ]
    keys = {gpu_build_key(v, "w" * 64) for v in variants} | {gpu_build_key(base, "v" * 64)}
    assert k not in keys and len(keys) == 5
    assert gpu_build_key(base, "w" * 64) == k  # deterministic
    # Runtime options are applied at serving: they do not invalidate an engine.
    same = base.model_copy(update={"runtime": base.runtime.model_copy(update={"kv_cache_free_gpu_mem_fraction": 0.5})})
    assert gpu_build_key(same, "w" * 64) == k


def test_matrix_pins_and_lookups():
    info = matrix.image_info(matrix.current_image())
    assert (info.trtllm, info.tensorrt, info.cuda, info.python, info.modelopt) == (
        "1.2.1", "10.14.1.48", "13.1.0", "3.12", "~=0.37.0")
    assert matrix.image_info(matrix.current_image() + "@sha256:" + "0" * 64) == info
    assert matrix.image_info("nvcr.io/nvidia/tritonserver:24.08-trtllm-python-py3").trtllm == "0.12.0"
    assert not matrix.image_info("nvcr.io/nvidia/tritonserver:24.08-trtllm-python-py3").supported
    assert matrix.gpu_info("h100-80gb").arch == "sm90" and matrix.gpu_info("l4").sm == 89


def test_end_id_prefers_the_turn_end_of_instruct_models():
    assert LLAMA.end_id == 128009 and LLAMA.context == 8192
    assert choose_end_id({}, {"eos_token_id": [128001, 128009]}, 128009) == 128009
    assert choose_end_id({}, {"eos_token_id": [5, 6]}, None) == 5
    assert choose_end_id({"eos_token_id": 2}, {}, None) == 2
    cfg = dict(LLAMA.__dict__)
    stretched = from_config({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128,
                             "max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert stretched.context == 8192 and cfg["heads"] == 32


def test_gather_context_logits_is_opt_in_and_changes_the_engine():
    """return_context_logits needs an engine built with --gather_context_logits; off by default (memory)."""
    base = load_spec(SPECS / "llama3-8b-fp16-a100-40gb-modal.yaml")
    assert "--gather_context_logits" not in trtllm.build_argv(base, LLAMA)
    on = base.model_copy(update={"build": base.build.model_copy(update={"gather_context_logits": True})})
    assert trtllm.build_argv(on, LLAMA).count("--gather_context_logits") == 1
    assert gpu_build_key(on, "w" * 64) != gpu_build_key(base, "w" * 64)


def _variants(section) -> list[tuple[str, object]]:
    """One other value for every field of a spec section, where its type offers one."""
    out = []
    for name, field in type(section).model_fields.items():
        value, hint = getattr(section, name), str(field.annotation)
        if isinstance(value, bool):
            out.append((name, not value))
        elif isinstance(value, int):
            out.append((name, value * 2))
        elif "Literal" in hint:
            out += [(name, v) for v in field.annotation.__args__ if isinstance(v, str) and v != value]
    return out


def test_the_build_key_holds_every_build_and_quantization_field_its_containers_read():
    # Derived, not listed: change each field; wherever a step's command changes, the key must change too
    # (the pytorch target's quantize step reads build.dtype, which its key once left out: a stale hit).
    for name in ("llama3-8b-fp8-h100-engine.yaml", "llama3-8b-fp8-llmapi-h100.yaml"):
        base = load_spec(SPECS / name)
        key, argv = gpu_build_key(base, "w" * 64), trtllm.step_argvs(base, LLAMA)
        checked = 0
        for section in ("build", "quantization"):
            for field, value in _variants(getattr(base, section)):
                try:
                    changed = base.model_copy(update={section: getattr(base, section).model_copy(
                        update={field: value})})
                except ValueError:
                    continue
                if trtllm.step_argvs(changed, LLAMA) != argv:
                    checked += 1
                    assert gpu_build_key(changed, "w" * 64) != key, f"{name}: {section}.{field}={value!r}"
        assert checked >= 3, name
