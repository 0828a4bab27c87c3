"""A run's GPU decision is made once, from the fetched files, and what build, package, stage and rollback use."""

from __future__ import annotations

import json

import pytest

from stoker.errors import PlanRefused
from stoker.gpu import decision, rollout
from stoker.gpu.facts import from_config
from stoker.spec.load import parse_spec

CURRENT = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
# Meta-Llama-3-70B-Instruct's config.json (the shapes the estimate reads).
CONFIG_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "eos_token_id": 128009}
FACTS = from_config(CONFIG_70B, source="known")


# H200s: the quantize worker spans the two GPUs of a 70B TP2 build and needs more than an H100 holds
# (stoker/gpu/memory.py; `stoker plan` refuses that on H100s, test_gpu_placement.py).
def spec(count: int, tp: int = 2, rollout_: str = "auto", gpu: str = "h200"):
    return parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-70B-Instruct"}, "storage": {"bucket": "bkt"},
                       "target": "tensorrt", "gpus": {"type": gpu, "count": count, "rollout": rollout_},
                       "deploy": {"image": CURRENT}, "quantization": {"format": "fp8"},
                       "parallel": {"tensor": tp}})


@pytest.mark.parametrize("held, candidate", [((), [0, 1]), ((0, 1), [2, 3]), ((2, 3), [0, 1]), ((1, 0), [2, 3])])
def test_surge_gives_the_candidate_the_set_the_live_backend_does_not_hold(held, candidate):
    d = decision.decide(spec(count=4), FACTS, held)
    assert d["rollout"]["choice"] == "surge" and d["sets"] == [[0, 1], [2, 3]]
    assert d["candidate"] == candidate and d["held"] == list(held)
    assert decision.build_gpus(spec(count=4), d) == tuple(candidate)  # the build runs where the candidate will


def test_the_decision_survives_the_manifest_and_is_the_plans_rollout():
    s = spec(count=2)
    d = json.loads(json.dumps(decision.decide(s, FACTS, ())))  # as the manifest keeps it
    assert decision.planned(d) == rollout.plan_rollout(s, FACTS)
    assert decision.planned(d).choice == "shared"
    capped = decision.with_cap(s, d)
    assert capped.runtime.max_tokens_in_paged_kv_cache == decision.planned(d).max_tokens_in_paged_kv_cache
    surge = spec(count=4)
    assert decision.with_cap(surge, decision.decide(surge, FACTS, ())) is surge


def test_the_decision_reads_the_fetched_folder_not_the_hub(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_70B))
    # The repo id names nothing the Hub or known_models.json has: only the folder can give these facts.
    s = spec(count=4).model_copy(update={"model": spec(4).model.model_copy(update={"repo_id": "nobody/nothing"})})
    d = decision.from_fetch(s, tmp_path, (0, 1))
    assert d["facts"] == "fetched files" and d["rollout"]["choice"] == "surge" and d["candidate"] == [2, 3]
    unknown = decision.from_fetch(s, tmp_path / "empty", ())
    assert unknown["rollout"] is None and unknown["facts"] == "unknown" and unknown["candidate"] == [0, 1]
    assert decision.planned(unknown) is None and decision.planned(None) is None


def test_a_reload_decision_says_so_and_keeps_one_set():
    # Spare GPUs 2 and 3 take the build; the candidate takes the live set once the live backend stops.
    d = decision.decide(spec(count=4, rollout_="reload"), FACTS, (0, 1))
    assert d["rollout"]["choice"] == "reload" and d["sets"] == [[0, 1]] and d["candidate"] == [0, 1]
    assert d["build"]["gpus"] == [2, 3]
    assert decision.planned(d).gap_s > 0
    # Without them, a build beside a reload rollout's live backend (nearly all of the GPUs) is refused.
    with pytest.raises(PlanRefused, match=r"^gpus: a rebuild while the live backend serves on GPUs \[0, 1\]"):
        decision.decide(spec(count=2, rollout_="reload"), FACTS, (0, 1))
