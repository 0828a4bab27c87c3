"""STAND-IN: the GPU memory ledger refuses, as CUDA would, a container whose GPUs lack the room (issue 48)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stoker.gpu import rollout, standin_ledger as ledger
from stoker.gpu.facts import known
from stoker.gpu.repository import write_repository
from stoker.spec.load import parse_spec

GIB = 1 << 30
LLAMA = known("meta-llama/Meta-Llama-3-8B-Instruct")


def spec(target: str = "tensorrt", **runtime):
    return parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
                       "target": target, "gpus": {"type": "h100-80gb", "count": 1, "rollout": "shared"},
                       "deploy": {"image": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"},
                       "quantization": {"format": "fp8"}, "runtime": runtime})


def test_held_bytes_counts_running_containers_on_those_gpus_only():
    cs = [SimpleNamespace(status="running", labels={"ai.stoker.gpus": "0,1", ledger.LABEL_BYTES: str(10 * GIB)}),
          SimpleNamespace(status="exited", labels={"ai.stoker.gpus": "0", ledger.LABEL_BYTES: str(50 * GIB)}),
          SimpleNamespace(status="running", labels={"ai.stoker.gpus": "2", ledger.LABEL_BYTES: str(5 * GIB)}),
          SimpleNamespace(status="running", labels={})]
    assert ledger.held_bytes(cs, (0, 2)) == {0: 10 * GIB, 2: 5 * GIB}


def test_a_backend_takes_its_fraction_of_what_is_free_when_it_starts_and_a_second_one_then_runs_out(tmp_path):
    # TensorRT-LLM sizes the KV cache from the memory free at start: an uncapped backend leaves too little for a
    # second one beside it (what a shared rollout's cap exists for).
    s = spec()
    write_repository(s, LLAMA, tmp_path / "repo")
    assert ledger.kv_settings(tmp_path / "repo") == (0.9, None)
    minimum, take = ledger.backend_take(s, LLAMA, tmp_path / "repo")
    size = ledger.gpu_bytes(s)
    first = ledger.admit("first", (0,), size, {0: 0}, minimum, take)
    assert minimum < first < size and size - first < 0.15 * size
    with pytest.raises(ledger.OutOfMemory, match=r"^CUDA out of memory \(STAND-IN ledger\): second needs ~"):
        ledger.admit("second", (0,), size, {0: first}, minimum, take)


def test_a_shared_rollouts_cap_leaves_the_candidate_its_room(tmp_path):
    planned = rollout.plan_rollout(spec(), LLAMA)
    capped = spec(max_tokens_in_paged_kv_cache=planned.max_tokens_in_paged_kv_cache)
    for target in ("tensorrt", "pytorch"):  # config.pbtxt's parameter, or model.yaml's kv_cache_config
        s = capped.model_copy(update={"target": target})
        repo = tmp_path / target
        write_repository(s, LLAMA, repo)
        assert ledger.kv_settings(repo) == (0.9, planned.max_tokens_in_paged_kv_cache)
        minimum, take = ledger.backend_take(s, LLAMA, repo)
        size = ledger.gpu_bytes(s)
        first = ledger.admit("live", (0,), size, {0: 0}, minimum, take)
        second = ledger.admit("candidate", (0,), size, {0: first}, minimum, take)
        assert first + second <= size
