"""GPU rollouts at plan time: surge onto spare GPUs, share the GPUs (KV split), or reload (a gap); impossible ones
refused in one line, before any download."""

from __future__ import annotations

import pytest

from stoker.errors import PlanRefused, SpecError
from stoker.gpu import matrix, planning, rollout
from stoker.gpu.facts import from_config, known
from stoker.gpu.rollout import Backend, choose, shared_kv_bytes
from stoker.plan import gpu as plan_gpu
from stoker.spec.load import parse_spec

CURRENT = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
GIB = 1 << 30
LLAMA8 = known("meta-llama/Meta-Llama-3-8B-Instruct")
# Meta-Llama-3-70B-Instruct's config.json (the shapes the estimate reads).
LLAMA70 = from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                       "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                       "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                       "torch_dtype": "bfloat16", "eos_token_id": 128009}, source="known")


def spec(gpu="h100-80gb", count=1, fmt="fp8", kv="none", tp=1, rollout_=None, **over):
    gpus = {"type": gpu, "count": count, **({"rollout": rollout_} if rollout_ else {})}
    data = {"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
            "target": "tensorrt", "gpus": gpus, "deploy": {"image": CURRENT},
            "quantization": {"format": fmt, "kv_cache_dtype": kv}, "parallel": {"tensor": tp}, **over}
    return parse_spec(data)


def plan(facts=LLAMA8, **kw) -> rollout.Rollout:
    return rollout.plan_rollout(spec(**kw), facts)


def refusal(facts=LLAMA8, **kw) -> str:
    with pytest.raises(PlanRefused) as err:
        plan(facts, **kw)
    text = str(err.value)
    assert "\n" not in text
    return text


# -- the engine sizes the estimate gives (rules.weight_bytes): the realistic ones ------------------------

@pytest.mark.parametrize("facts, fmt, gb", [(LLAMA8, "none", 16.1), (LLAMA8, "fp8", 9.1), (LLAMA8, "int4_awq", 5.6),
                                            (LLAMA70, "fp8", 72.7)])
def test_engine_sizes_are_the_realistic_ones(facts, fmt, gb):
    b = rollout.backend_of(spec(fmt=fmt), facts)
    assert round(b.engine_bytes / 1e9, 1) == gb


# -- each choice over the matrix's GPUs, one GPU (no spare: shared or reload) ----------------------------------------

@pytest.mark.parametrize("gpu, fmt, choice", [
    ("l4", "none", "reload"),  # 16 GB engine: two do not fit 24 GB
    ("l4", "fp8", "reload"),  # 2 × 9 GB engines leave no room for one 8192-token sequence each
    ("l4", "int4_awq", "shared"),
    ("a100-40gb", "none", "shared"),
    ("a100-40gb", "int4_awq", "shared"),
    ("a100-80gb", "none", "shared"),
    ("h100-80gb", "none", "shared"),
    ("h100-80gb", "fp8", "shared"),
    ("h200", "fp8", "shared"),
])
def test_one_gpu_8b(gpu, fmt, choice):
    r = plan(gpu=gpu, fmt=fmt)
    assert r.choice == choice and r.world == 1 and r.blue == (0,)
    if choice == "shared":
        assert r.green == (0,) and r.max_tokens_in_paged_kv_cache == r.kv_tokens >= 8192
        assert r.kv_tokens < r.kv_tokens_alone / 2  # the cost: each keeps under half of what it had alone
    else:
        assert r.green == () and r.gap_s > 0 and r.kv_tokens == r.kv_tokens_alone


@pytest.mark.parametrize("gpu, tp, count, choice", [
    ("h100-80gb", 1, 1, "reload"),  # 68 GiB engine: fits alone, not twice
    ("h200", 1, 1, "reload"),  # 141 GB: still not twice
    ("h100-80gb", 2, 2, "shared"),
    ("h100-80gb", 4, 4, "shared"),
    ("h100-80gb", 8, 8, "shared"),
    ("h200", 2, 2, "shared"),
    ("h200", 8, 8, "shared"),
    ("h100-80gb", 2, 4, "surge"),
    ("h100-80gb", 4, 8, "surge"),
    ("h200", 2, 8, "surge"),
])
def test_70b_fp8_over_tensor_parallel(gpu, tp, count, choice):
    r = plan(LLAMA70, gpu=gpu, tp=tp, count=count)
    assert r.choice == choice and r.world == tp and len(r.blue) == tp
    if choice == "surge":
        assert r.green == tuple(range(tp, 2 * tp)) and r.unused == tuple(range(2 * tp, count))


def test_70b_fp16_on_one_h100_is_refused():
    text = refusal(LLAMA70, fmt="none")
    assert text.startswith("gpus.type: one backend needs ~") and "the NVIDIA H100 80GB has 79.6 GiB" in text


# -- 1, 2 and 8 GPUs --------------------------------------------------------------------------------------------

def test_one_two_eight_gpus():
    one, two, eight = (plan(count=n) for n in (1, 2, 8))
    assert one.choice == "shared"
    assert two.choice == "surge" and (two.blue, two.green, two.unused) == ((0,), (1,), ())
    assert eight.choice == "surge" and eight.green == (1,) and eight.unused == (2, 3, 4, 5, 6, 7)
    assert two.kv_tokens == two.kv_tokens_alone and two.gap_s is None and two.kv_cost_pct == 0
    assert "GPUs [2, 3, 4, 5, 6, 7] stay unused" in eight.note()


def test_surge_takes_the_listed_device_ids():
    s = parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
                    "target": "tensorrt", "deploy": {"image": CURRENT}, "quantization": {"format": "fp8"},
                    "parallel": {"tensor": 2}, "gpus": {"type": "h100-80gb", "count": 4, "device_ids": [4, 5, 2, 3]}})
    r = rollout.plan_rollout(s, LLAMA8)
    assert (r.blue, r.green) == ((4, 5), (2, 3))


def test_the_spec_can_ask_for_a_costlier_choice():
    assert plan(count=2, rollout_="shared").choice == "shared"
    assert plan(count=2, rollout_="reload").choice == "reload"
    assert plan(rollout_="reload").choice == "reload"
    assert plan(gpu="l4", fmt="int4_awq", rollout_="reload").choice == "reload"


# -- the KV split -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", ["l4", "a100-40gb", "a100-80gb", "h100-80gb", "h200"])
@pytest.mark.parametrize("fraction", [0.5, 0.9, 1.0])
def test_kv_split_gives_both_backends_the_same_cache_in_either_order(gpu, fraction):
    """Replay TensorRT-LLM's allocation (fraction of what is free, at most max_tokens): the one alone, then the
    candidate; after retire, the next candidate again. Both get the cap, and together they fit."""
    m = matrix.gpu_info(gpu).memory_mib << 20
    b = Backend(fixed_bytes=int(7.8 * GIB), engine_bytes=int(5.2 * GIB), kv_bytes_per_token=131072, seq_len=1024)
    r = choose("shared", matrix.gpu_info(gpu), [0], 1, b, fraction)
    cap = r.max_tokens_in_paged_kv_cache
    first = rollout.kv_tokens(m - b.fixed_bytes, fraction, b.kv_bytes_per_token, cap)
    second = rollout.kv_tokens(m - b.fixed_bytes - first * b.kv_bytes_per_token - b.fixed_bytes, fraction,
                               b.kv_bytes_per_token, cap)
    assert first == cap and cap - 1 <= second <= cap
    assert 2 * b.fixed_bytes + (first + second) * b.kv_bytes_per_token <= m
    # the first one's cap, as the fraction of what it finds free
    assert r.first_fraction == pytest.approx(cap * b.kv_bytes_per_token / (m - b.fixed_bytes), abs=1e-3)
    assert r.kv_tokens_alone == int((m - b.fixed_bytes) * fraction) // b.kv_bytes_per_token


def test_kv_split_arithmetic():
    # K = f (M - 2F) / (1 + f): 80 GiB, two 20 GiB backends, f 0.9 → 0.9 × 40 / 1.9 GiB each
    assert shared_kv_bytes(80 * GIB, 20 * GIB, 0.9) == int(0.9 * 40 * GIB / 1.9)
    assert shared_kv_bytes(80 * GIB, 50 * GIB, 0.9) == 0
    r = plan(fmt="fp8")  # H100, 8B fp8, fraction 0.9, 128 KiB of fp16 KV per token
    b = rollout.backend_of(spec(fmt="fp8"), LLAMA8)
    assert b.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert r.max_tokens_in_paged_kv_cache == shared_kv_bytes(81559 << 20, b.fixed_bytes, 0.9) // 131072
    assert r.kv_cost_pct == round(100 * (1 - r.kv_tokens / r.kv_tokens_alone), 1) and 50 < r.kv_cost_pct < 60


def test_fp8_kv_doubles_the_tokens_of_the_split():
    fp16, fp8 = plan(fmt="fp8"), plan(fmt="fp8", kv="fp8")
    assert fp8.kv_tokens in (2 * fp16.kv_tokens, 2 * fp16.kv_tokens + 1)


def test_a_smaller_cap_in_the_spec_is_kept():
    r = plan(runtime={"max_tokens_in_paged_kv_cache": 20000})
    assert r.choice == "shared" and r.max_tokens_in_paged_kv_cache == 20000 and r.kv_tokens_alone == 20000


def test_reload_gap():
    b = rollout.backend_of(spec(gpu="l4", fmt="none"), LLAMA8)
    r = plan(gpu="l4", fmt="none")
    assert r.gap_s == round(rollout.STOP_S + rollout.START_S + b.engine_bytes / rollout.LOAD_BYTES_PER_S + 3.0, 1)
    warm = rollout.reload_gap_s(int(2e9), 0, pytorch_backend=True)
    assert warm == rollout.reload_gap_s(int(2e9), 0) + rollout.PYTORCH_EXTRA_S
    assert f"expected gap ~{r.gap_s:.0f} s" in r.note()


# -- refusals, one line each -----------------------------------------------------------------------------------

def test_surge_with_no_spare_gpu():
    assert refusal(rollout_="surge") == ("gpus.rollout: surge needs 1 spare GPU(s) beyond the 1 one backend uses, "
                                         "but gpus lists 1 ([0]): add device ids (count 2) or use rollout shared, "
                                         "reload or auto")
    assert refusal(LLAMA70, tp=4, count=6, rollout_="surge").startswith(
        "gpus.rollout: surge needs 4 spare GPU(s) beyond the 4 one backend uses, but gpus lists 6")


def test_shared_that_does_not_fit():
    text = refusal(gpu="l4", fmt="none", rollout_="shared")
    assert text.startswith("gpus.rollout: shared needs ~") and "the NVIDIA L4 has 22.5 GiB: use rollout reload" in text


def test_an_engine_that_does_not_fit_alone():
    text = refusal(gpu="l4", fmt="none", build={"max_seq_len": 8192, "max_num_tokens": 65536})
    assert text.startswith("gpus.type: one backend needs ~") and "the NVIDIA L4 has 22.5 GiB" in text


@pytest.mark.parametrize("gpus, message", [
    ({"type": "h100-80gb", "count": 2, "device_ids": [1, 1]},
     "gpus: device id 1 is listed more than once in device_ids; list each GPU once"),
    ({"type": "h100-80gb", "count": 2, "device_ids": [0, 64]}, "gpus: device id 64 is out of range 0..63"),
    ({"type": "h100-80gb", "count": 2, "device_ids": [-1, 0]}, "gpus: device id -1 is out of range 0..63"),
    ({"type": "h100-80gb", "count": 2, "device_ids": [0]}, "gpus: device_ids must be 2"),
    ({"type": "h100-80gb", "rollout": "blue-green"}, "gpus.rollout: Input should be 'auto', 'surge', 'shared' or"),
])
def test_bad_device_ids_one_line(gpus, message):
    with pytest.raises(SpecError) as err:
        parse_spec({"model": {"repo_id": "org/m"}, "storage": {"bucket": "bkt"}, "target": "tensorrt", "gpus": gpus},
                   "s.yaml")
    assert str(err.value).startswith("s.yaml: " + message) and "\n" not in str(err.value)


# -- the spec field and the plan -----------------------------------------------------------------------------------

def test_auto_stays_out_of_dumps_so_digests_do_not_move():
    a, b = spec(), spec(rollout_="auto")
    assert "rollout" not in a.model_dump(mode="json")["gpus"] and a.digest() == b.digest()
    assert spec(rollout_="reload").model_dump(mode="json")["gpus"]["rollout"] == "reload"


def test_plan_refuses_before_the_fetch_and_prints_one_row(monkeypatch):
    monkeypatch.setattr(planning, "model_facts", lambda s: LLAMA8)
    monkeypatch.setattr(planning, "token_present", lambda s: True)
    with pytest.raises(PlanRefused, match="^gpus.rollout: surge needs"):
        planning.check_spec(spec(rollout_="surge"))
    facts, findings = planning.check_spec(spec(count=2))
    assert not any(f.field == "gpus.count" for f in findings)  # the spare GPU holds the next candidate
    assert any(f.field == "gpus.count" for f in planning.check_spec(spec(count=2, rollout_="reload"))[1])
    row = plan_gpu.rollout_row(spec(count=2), facts)
    assert (row.name, row.status) == ("rollout", "surge") and row.note.startswith("surge: the candidate starts on")
    row = plan_gpu.rollout_row(spec(), None)
    assert (row.name, row.status) == ("rollout", "unknown")


def test_the_shared_cap_reaches_the_rendered_config_and_surge_leaves_it_alone():
    from stoker.gpu import inflight

    shared = spec(count=1)  # one H100, an 8B fp8 engine: shared
    from stoker.gpu import decision

    capped = decision.with_cap(shared, decision.decide(shared, LLAMA8, ()))
    want = plan(count=1).max_tokens_in_paged_kv_cache
    assert want and inflight.backend_parameters(capped)["max_tokens_in_paged_kv_cache"] == str(want)
    surge = spec(count=2)
    assert decision.with_cap(surge, decision.decide(surge, LLAMA8, ())) is surge
    assert "max_tokens_in_paged_kv_cache" not in inflight.backend_parameters(surge)


def test_replicas_take_gpu_sets_of_their_own_and_too_many_are_refused_in_one_line():
    from stoker.spec.load import parse_spec as parse

    def with_replicas(count, n):
        return parse({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
                      "target": "tensorrt", "gpus": {"type": "h100-80gb", "count": count},
                      "deploy": {"image": CURRENT, "replicas": n}})

    eight = rollout.plan_rollout(with_replicas(8, 4), LLAMA8)
    assert (eight.choice, eight.blue, eight.green) == ("surge", (0, 1, 2, 3), (4, 5, 6, 7))
    assert rollout.plan_rollout(with_replicas(4, 4), LLAMA8).choice == "shared"
    with pytest.raises(PlanRefused) as err:
        rollout.plan_rollout(with_replicas(2, 4), LLAMA8)
    assert str(err.value).startswith("deploy.replicas: 4 replicas of 1 GPU(s) each (tensor x pipeline) need 4 GPUs "
                                     "but gpus lists 2")


def test_replicas_with_an_in_place_reload_are_refused():
    with pytest.raises(SpecError, match="replicas 2 with rollout reload"):
        parse_spec({"model": {"repo_id": "a/b"}, "storage": {"bucket": "bkt"},
                    "deploy": {"replicas": 2, "rollout": "reload"}})
    assert "replicas" not in parse_spec({"model": {"repo_id": "a/b"}, "storage": {"bucket": "bkt"}}).model_dump()["deploy"]
