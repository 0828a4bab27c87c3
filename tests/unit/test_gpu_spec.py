"""The GPU sections of the spec and the per-target quantization rules; reference behaviour unchanged."""

from __future__ import annotations

import pytest

from stoker.errors import SpecError
from stoker.spec.load import parse_spec

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "my-bucket"}}


def test_gpu_sections_default_to_upstream_values():
    spec = parse_spec({**BASE, "target": "tensorrt", "gpus": {"type": "h100-80gb"}})
    b, r = spec.build, spec.runtime
    assert (b.max_batch_size, b.max_num_tokens, b.tokens_per_block, b.max_input_len) == (2048, 8192, 32, 1024)
    assert b.max_seq_len is None and b.kv_cache_type == "paged" and b.use_paged_context_fmha
    assert r.kv_cache_free_gpu_mem_fraction == 0.9 and r.decoupled
    assert spec.gpus.ids == [0] and spec.parallel.world_size == 1


@pytest.mark.parametrize("data, message", [
    ({"target": "tensorrt"}, "gpus: required for target 'tensorrt'"),
    ({"target": "pytorch", "gpus": {"type": "l4", "count": 2, "device_ids": [0]}}, "gpus: device_ids must be 2"),
    ({"quantization": {"format": "nvfp4"}}, "quantization: format 'nvfp4' needs a GPU target"),
    ({"quantization": {"format": "int8_wo"}}, "quantization: format 'int8_wo' needs a GPU target"),
    ({"target": "tensorrt", "gpus": {"type": "l4"}, "build": {"tokens_per_block": 48}},
     "build.tokens_per_block: 48 is not a power of two"),
    ({"target": "tensorrt", "gpus": {"type": "l4"}, "build": {"max_output_len": 10}}, "build.max_output_len: unknown key"),
    ({"deploy": {"image_digest": "latest"}}, "deploy.image_digest: 'latest' is not a digest"),
    ({"target": "tensorrt", "gpus": {"type": "l4"}, "runtime": {"kv_cache_free_gpu_mem_fraction": 1.5}},
     "runtime.kv_cache_free_gpu_mem_fraction: Input should be less than or equal to 1"),
])
def test_bad_gpu_values_give_one_line(data, message):
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, **data}, "s.yaml")
    assert str(err.value).startswith("s.yaml: " + message), str(err.value)


def test_kv_int8_only_for_gpu_targets():
    with pytest.raises(SpecError, match="kv_cache_dtype 'int8' cannot be exported"):
        parse_spec({**BASE, "quantization": {"format": "fp8", "kv_cache_dtype": "int8"}})
    spec = parse_spec({**BASE, "target": "tensorrt", "gpus": {"type": "l4"},
                       "quantization": {"format": "int8_sq", "kv_cache_dtype": "int8"}})
    assert spec.quantization.kv_cache_dtype == "int8"


def test_example_gpu_specs_validate():
    from pathlib import Path

    from stoker.spec.load import load_spec

    specs = sorted((Path(__file__).resolve().parents[2] / "deployments" / "specs").glob("llama3-*.yaml"))
    assert len(specs) >= 6
    for p in specs:
        spec = load_spec(p)
        assert spec.target in ("tensorrt", "pytorch")
        assert spec.deploy.image == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
