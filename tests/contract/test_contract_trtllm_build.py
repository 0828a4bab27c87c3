"""Contract: every rendered container command against TRT-LLM 1.2's own argument lists (tests/contract/upstream)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# Flags of 2024-era tutorials that TRT-LLM 1.2's trtllm-build no longer has (shared/UPSTREAM.md).
REMOVED = {"--max_output_len", "--use_custom_all_reduce", "--multi_block_mode", "--context_fmha_fp32_acc",
           "--tp_size", "--pp_size", "--enable_xqa", "--strongly_typed", "--builder_opt", "--auto_parallel",
           "--world_size", "--use_inflight_batching", "--use_gemm_plugin", "--use_gpt_attention_plugin"}
VALUE_CHOICES = {"--kv_cache_type": {"paged", "continuous", "disabled"}}


def _flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _step(doc: dict, name: str) -> dict | None:
    return next((s for s in doc["steps"] if s["name"] == name), None)


@pytest.mark.targets("pytorch")
def test_llmapi_target_builds_no_engine(rendered):
    assert _step(rendered["doc"], "build") is None, "the LLM-API target builds no engine"
    assert [s["name"] for s in rendered["doc"]["steps"]] == ["quantize"]  # serving is stoker/serving's


@pytest.mark.targets("tensorrt")
def test_build_flags_exist_and_none_removed_or_deprecated(rendered, build_flags):
    build = _step(rendered["doc"], "build")
    assert build is not None, "the engine target builds an engine"
    argv = build["argv"]
    assert argv[0] == "trtllm-build"
    flags = _flags(argv)
    assert len(flags) == len(set(flags)), "a flag given twice"
    unknown = set(flags) - build_flags["accepted"]
    assert not unknown, f"not accepted by trtllm-build 1.2: {sorted(unknown)}"
    assert not set(flags) & REMOVED
    assert not set(flags) & (build_flags["deprecated"] | build_flags["unsupported"])
    values = dict(zip(argv[1::2], argv[2::2]))
    for flag in ("--remove_input_padding", "--context_fmha", "--use_paged_context_fmha", "--use_fp8_context_fmha",
                 "--multiple_profiles"):
        assert values[flag] in ("enable", "disable"), flag
    assert values["--kv_cache_type"] in VALUE_CHOICES["--kv_cache_type"]
    # max_seq_len, not max_output_len: input + output must fit it.
    assert int(values["--max_seq_len"]) > int(values["--max_input_len"])
    # A timing cache shared across builds, named by GPU arch and TRT-LLM.
    assert values["--input_timing_cache"] == values["--output_timing_cache"]
    assert values["--input_timing_cache"].endswith("-trtllm1.2.1.cache")


def test_quantize_step_uses_upstream_formats(rendered, qformats):
    doc = rendered["doc"]
    step = _step(doc, "quantize") or _step(doc, "checkpoint")
    assert step is not None, "every example spec quantizes (or converts) its weights in a container step"
    values = dict(zip(step["argv"][3::2], step["argv"][4::2]))
    fmt = values["--format"]
    assert fmt == "none" or fmt in qformats["qformat"], fmt
    assert values["--kv-cache-dtype"] == "none" or values["--kv-cache-dtype"] in qformats["kv_cache_dtype"]
    # The step runs in the serving image itself: build and serve with one TRT-LLM.
    assert step["image"].startswith(doc["image"]["image"])
    assert all(s["image"] == step["image"] for s in doc["steps"])
    # The image's ModelOpt is the one its TRT-LLM pins.
    assert "nvidia-modelopt[torch]" + doc["image"]["modelopt"] in qformats["modelopt_pin"]


def test_steps_request_gpus_shm_and_no_secret_values(rendered):
    doc = rendered["doc"]
    text = json.dumps(doc)
    assert "hf_contract_placeholder" not in text
    for step in doc["steps"]:
        assert step["gpus"] == doc["gpus"]["device_ids"][:doc["gpus"]["tensor_parallel"] * doc["gpus"]["pipeline_parallel"]]
        assert step["shm_size"] == "2g"
        assert step["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    # Serving is not a container step: stoker/serving runs it on a backend's own ports (serve_command).
    assert "serve" not in [s["name"] for s in doc["steps"]]
    assert "--model-repository=/models" in doc["serve_command"] or "/models" in doc["serve_command"]


@pytest.mark.parametrize("world, expect", [(1, "tritonserver --model-repository=/models"),
                                          (2, "mpirun --allow-run-as-root -n 1 tritonserver")])
def test_multi_rank_serve_runs_one_mpi_rank_per_gpu(world, expect):
    from stoker.gpu.trtllm import serve_command
    from stoker.containers.ports import Ports
    from stoker.spec.load import parse_spec

    spec = parse_spec({"model": {"repo_id": "a/b"}, "storage": {"bucket": "bkt"}, "target": "tensorrt",
                       "gpus": {"type": "h100-80gb", "count": world}, "parallel": {"tensor": world},
                       "deploy": {"openai": False}})
    assert " ".join(serve_command(spec, Ports(1, 2, 3), [])).startswith(expect)


def test_gather_context_logits_flag_is_upstreams(build_flags):
    """return_context_logits on the engine target needs this build flag; it must be one trtllm-build 1.2 accepts."""
    from stoker.gpu import trtllm
    from stoker.gpu.facts import known
    from stoker.spec.load import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "deployments/specs/llama3-8b-fp8-h100-engine.yaml")
    spec = spec.model_copy(update={"build": spec.build.model_copy(update={"gather_context_logits": True})})
    flags = [a for a in trtllm.build_argv(spec, known("meta-llama/Meta-Llama-3-8B-Instruct")) if a.startswith("--")]
    assert "--gather_context_logits" in flags
    assert "--gather_context_logits" in build_flags["accepted"]
    assert "--gather_context_logits" not in build_flags["deprecated"] | build_flags["unsupported"]
