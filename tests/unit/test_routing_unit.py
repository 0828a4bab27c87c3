"""Routing's pure parts: the spec section's one-line refusals, its absence from the digest when unset, and a
routed step's local read that never builds here."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.errors import StokerError
from stoker.run import RunContext, cached_step
from stoker.errors import SpecError
from stoker.spec.load import parse_spec

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "abc"}}


def _spec(**over):
    data = {**BASE, **over}
    return parse_spec(data, "it")


def test_unset_routing_leaves_the_spec_digest_and_dump_as_before():
    plain = _spec()
    assert "routing" not in plain.model_dump(mode="json")
    assert plain.digest() == _spec(routing={}).digest()
    routed = _spec(storage={"bucket": "abc", "shared_cache": True}, routing={"heavy": "heavy_steps/gpu"})
    assert routed.model_dump(mode="json")["routing"]["heavy"] == "heavy_steps/gpu"
    assert routed.digest() != plain.digest()


@pytest.mark.parametrize("over, says", [
    ({"routing": {"heavy": "heavy_steps/gpu"}}, "routing.heavy needs storage.shared_cache: true"),
    ({"storage": {"bucket": "abc", "shared_cache": True}, "routing": {"heavy": "gpu"}},
     "'gpu' is not FLOW/DEPLOYMENT"),
    ({"model": {"local_path": "/tmp"}, "storage": {"bucket": "abc", "shared_cache": True},
      "routing": {"heavy": "heavy_steps/gpu"}}, "routing.heavy needs a Hub model"),
    ({"storage": {"bucket": "abc", "shared_cache": True}, "routing": {"heavy": "a/b", "start_timeout_s": 0}},
     "routing.start_timeout_s"),
])
def test_bad_routing_is_refused_in_one_line(over, says):
    with pytest.raises(SpecError) as err:
        _spec(**over)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_routed_step_missing_from_the_cache_is_an_error_not_a_build_here(tmp_path: Path):
    ctx = RunContext.new(tmp_path).model_copy(update={"routed_to": "heavy_steps/gpu"})
    built = []

    def produce(out: Path) -> dict:
        built.append(out)
        return {}

    with pytest.raises(StokerError, match=r"build: k1 is not in the shared cache after the routed run of "
                                          r"heavy_steps/gpu; it runs there, not here"):
        cached_step(ctx, "build", "k1", produce, lambda _m: None)
    assert built == [] and not list((tmp_path / "cache").glob("build/k1*"))

    # Unrouted, the same call builds here and says so in its manifest entry.
    done = cached_step(RunContext.new(tmp_path), "build", "k1", produce, lambda _m: None)
    assert built and done.layer == "built" and done.ran_on.endswith(f":{tmp_path}")
    entry = done.manifest_entry()
    assert entry["layer"] == "built" and "pulled_bytes" not in entry
    again = cached_step(RunContext.new(tmp_path), "build", "k1", produce, lambda _m: None)
    assert again.cache_hit and again.layer == "local" and again.ran_on is None


def test_plan_says_where_a_routed_miss_runs(monkeypatch, tmp_path: Path):
    from stoker import targets
    from stoker.plan import compose as plan
    from stoker.plan.compose import PlannedStep

    rows = [PlannedStep("fetch", "k0", "hit"), PlannedStep("quantize", "k1", "miss"),
            PlannedStep("build", None, "pending", "key known once the previous step has run")]
    monkeypatch.setattr(type(targets.get("reference")), "plan", lambda self, spec, ctx: list(rows))
    spec = _spec(storage={"bucket": "abc", "shared_cache": True}, routing={"heavy": "heavy_steps/gpu"},
                 evaluation={"enabled": False})
    out = {s.name: s.note for s in plan.plan(spec, RunContext.new(tmp_path))}
    assert out["fetch"] == ""
    assert out["quantize"] == "runs on heavy_steps/gpu's pool (routing.heavy)"
    assert out["build"] == "key known once the previous step has run; runs on heavy_steps/gpu's pool (routing.heavy)"


def test_overhead_is_the_wall_time_no_step_covered():
    from stoker.record.manifest import covered_s
    from stoker.run import StepResult

    def step(name, start, dur):
        return StepResult(name=name, duration_s=dur, started_at=start)

    # fetch 0-2, deploy 2-10, baseline 3-9 (inside deploy), benchmark 11-12: 11 s covered, not 2+8+6+1 = 17.
    steps = [step("fetch", 100, 2), step("deploy", 102, 8), step("baseline", 103, 6), step("benchmark", 111, 1)]
    assert covered_s(steps) == 11
    # Partly overlapping, and touching intervals.
    assert covered_s([step("a", 0, 5), step("b", 3, 5), step("c", 8, 1)]) == 9
    # A step without a start (an older producer): the sum of durations, as before.
    assert covered_s([step("a", 0, 5), StepResult(name="b", duration_s=5)]) == 10
    assert covered_s([]) == 0
