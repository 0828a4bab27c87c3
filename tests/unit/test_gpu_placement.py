"""Where a GPU build and the automatic bf16 baseline run: never into the live backend's memory (issue 48).

The numbers are stoker/gpu/placement.py's estimates (the quantize worker's from stoker/gpu/memory.py, compared with
an H100 in benchmarks/results/gpu_quantize.json); these tests check the decisions made from them."""

from __future__ import annotations

import pytest

from stoker.errors import PlanRefused
from stoker.gpu import decision, placement, rollout
from stoker.gpu.facts import known
from stoker.spec.load import parse_spec

CURRENT = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
LLAMA = known("meta-llama/Meta-Llama-3-8B-Instruct")


def spec(gpu: str, count: int, fmt: str = "fp8", rollout_: str = "auto", target: str = "tensorrt", **extra):
    return parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
                       "target": target, "gpus": {"type": gpu, "count": count, "rollout": rollout_},
                       "deploy": {"image": CURRENT}, "quantization": {"format": fmt}, **extra})


def test_a_rebuild_that_fits_nowhere_beside_what_serves_is_refused_at_plan_with_the_gib():
    # A100 40GB, fp16 engine, one GPU: the plan picks reload (two engines do not fit), so the live backend keeps
    # nearly all of the GPU; the quantize worker's bf16 copy of the model cannot run beside it.
    s = spec("a100-40gb", 1, fmt="none", build={"max_batch_size": 128, "max_input_len": 256, "max_seq_len": 512,
                                                  "max_num_tokens": 32768})  # deployments/specs' modal example
    planned = rollout.plan_rollout(s, LLAMA)
    assert planned.choice == "reload"
    with pytest.raises(PlanRefused) as err:
        placement.plan_rebuild(s, LLAMA, planned)
    text = str(err.value)
    assert "\n" not in text and text.startswith("gpus: a rebuild while the first backend serves on GPUs [0]")
    need = placement.build_need_bytes(s, LLAMA)
    step = max(need, key=need.get)
    assert f"the build's {step} step needs ~{need[step] / 2**30:.1f} GiB per GPU" in text
    assert "of 40.0 GiB (reload rollout)" in text
    assert "gpus.count 2" in text
    # The fix it names works: a second device id takes the build while GPU 0 serves.
    two = spec("a100-40gb", 2, fmt="none", rollout_="reload", build={"max_batch_size": 128, "max_input_len": 256,
                                                                      "max_seq_len": 512, "max_num_tokens": 32768})
    placed = placement.plan_rebuild(two, LLAMA, rollout.plan_rollout(two, LLAMA))
    assert placed["gpus"] == [1] and placed["where"] == "GPUs no backend holds"


def test_the_build_runs_beside_the_live_backend_only_where_the_memory_left_beside_it_holds_it():
    s = spec("h100-80gb", 1, rollout_="shared")
    planned = rollout.plan_rollout(s, LLAMA)
    live = placement.live_bytes(s, LLAMA, planned)
    placed = placement.place_build(s, LLAMA, planned, (0,))
    assert placed["gpus"] == [0] and placed["where"] == "beside the live backend"
    assert placed["free_bytes"] == planned.gpu_bytes - live and max(placed["need_bytes"].values()) <= live
    assert placement.place_build(s, LLAMA, planned, ())["where"] == "nothing serves yet"


def test_the_decision_records_where_the_build_runs_and_the_build_uses_it():
    s = spec("h100-80gb", 2, rollout_="shared")  # GPU 1 is listed but no backend uses it: builds go there
    d = decision.decide(s, LLAMA, (0,))
    assert d["rollout"]["choice"] == "shared" and d["candidate"] == [0]
    assert d["build"]["gpus"] == [1] and decision.build_gpus(s, d) == (1,)


def test_the_bf16_baseline_never_stops_or_shares_the_live_backend():
    s = spec("h100-80gb", 1, rollout_="shared")  # the build fits beside the live backend; a second backend would not
    d = decision.decide(s, LLAMA, (0,))
    assert d["build"]["gpus"] == [0]
    assert d["baseline"]["gpus"] is None and "[0] serving" in d["baseline"]["why"]
    alone = decision.decide(s, LLAMA, ())  # nothing serves yet: its own GPU is free
    assert alone["baseline"]["gpus"] == [0]
    staged = decision.for_baseline(alone)
    assert decision.planned(staged) is None  # no reload rollout: staging stops nothing
    assert staged["candidate"] == [0] and staged["build"]["gpus"] == [0] and staged["settled"]
    reload = spec("h100-80gb", 2, rollout_="reload")  # GPU 1 is spare: the baseline and the build go there
    d = decision.decide(reload, LLAMA, (0,))
    assert d["baseline"]["gpus"] == [1] and d["build"]["gpus"] == [1]
    with pytest.raises(PlanRefused, match="gpus.count 2"):  # one GPU under reload: no room for the build at all
        decision.decide(spec("h100-80gb", 1, rollout_="reload"), LLAMA, (0,))


def test_the_candidate_is_settled_once_from_what_serves_under_the_lock():
    s = spec("h100-80gb", 2)  # surge: sets [0] and [1]
    early = decision.decide(s, LLAMA, ())
    assert early["candidate"] == [0]
    # Another run switched to GPU 0 while this one built: the candidate takes the other set.
    settled = decision.settle(s, early, (0,))
    assert settled["candidate"] == [1] and settled["held"] == [0] and settled["settled"]
    assert settled["build"] == early["build"] and settled["rollout"] == early["rollout"]


def test_settle_rechooses_the_baseline_only_where_gpus_were_the_reason():
    s = spec("h100-80gb", 1, rollout_="shared")
    early = decision.decide(s, LLAMA, (0,))  # its one GPU serves: no room for the baseline now
    assert early["baseline"]["gpus"] is None and early["baseline"]["fits"]
    assert decision.settle(s, early, ())["baseline"]["gpus"] == [0]  # nothing served any more under the lock
    # A refusal for memory (a bf16 backend larger than one GPU) no placement changes: it stays as it was.
    too_big = {**early, "baseline": {"gpus": None, "fits": False, "why": "a bf16 backend needs ~90 GiB per GPU"}}
    assert decision.settle(s, too_big, ())["baseline"] == too_big["baseline"]
