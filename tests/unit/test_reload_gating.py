"""`rollout: reload` never serves an ungated build (issue 49 items 2-3): the pure parts.

plan_repair never makes a backend live that the proxy never switched to (a candidate of a killed run, possibly
ungated); the live repository pins every config to the recorded version, and its version folders are read back
for the reconcile that removes half-published ones; GPU targets refuse reload at plan, in one line.
"""

from __future__ import annotations

import pytest

from stoker import targets
from stoker.containers.ports import Ports
from stoker.deploy.rollout import folder_versions, pin_version, version_key
from stoker.errors import PlanRefused
from stoker.gpu.facts import known
from stoker.serving.topology import Backend, ProxyView, plan_repair
from stoker.spec.load import parse_spec

LISTEN = Ports(8000, 8001, 8002)


def backend(name: str, slot: str, port: int, created: int, *, served: bool, running=True, ready=True) -> Backend:
    return Backend(name, slot, Ports(port, port + 1, port + 2), "d", running, ready, ("t", created), served=served)


def test_a_dead_routed_backend_is_never_replaced_by_a_candidate_that_never_served():
    dead = backend("live", "blue", 20000, 1, served=True, running=False, ready=False)
    leftover = backend("cand", "green", 20003, 2, served=False)  # a killed run's candidate: ready, never gated
    r = plan_repair([dead, leftover], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live is None and set(r.remove) == {dead, leftover} and r.reroute
    assert "cand never served" in r.why and "answers 503" in r.why
    assert r.actions()[-1] == r.why and "route the proxy to nothing" in r.actions()


def test_with_the_proxy_gone_only_a_backend_that_served_before_takes_over():
    older = backend("old", "blue", 20000, 1, served=True)
    newer = backend("cand", "green", 20003, 2, served=False)  # newer, ready: once chosen for being newest
    r = plan_repair([older, newer], ProxyView(False, False), LISTEN)
    assert r.live is older and r.remove == (newer,) and r.proxy == "create" and r.why == ""
    # Of two that served, the newer one (the last switch's target).
    again = backend("again", "green", 20003, 3, served=True)
    assert plan_repair([older, again], ProxyView(True, False, listen=LISTEN), LISTEN).live is again
    # The routed backend stays live whether or not it is recorded (a deployment older than the record).
    routed = backend("r", "blue", 20000, 1, served=False)
    r = plan_repair([routed], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live is routed and r.actions() == []


def test_every_live_config_is_pinned_to_one_version_and_a_new_pin_replaces_the_old():
    config = 'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: 0\n'
    pinned = pin_version(config, 3)
    assert pinned.endswith("version_policy: { specific: { versions: [3] } }\n") and pinned.startswith(config)
    repinned = pin_version(pinned, 4)
    assert repinned.count("version_policy") == 1 and "versions: [4]" in repinned


def test_version_folders_are_read_from_the_live_repository_keys():
    root = "p/live/x/model_repository"
    keys = [f"{root}/ensemble/config.pbtxt", f"{root}/ensemble/1/.keep", f"{root}/tensorrt_llm/2/model.py",
            f"{root}/tensorrt_llm/config.pbtxt", f"{root}/stray.txt"]
    assert folder_versions(keys, root) == {1, 2}
    assert version_key("r/model_repository/m/1/a/b", "r/model_repository", "L", 7) == "L/m/7/a/b"
    assert version_key("r/model_repository/m/config.pbtxt", "r/model_repository", "L", 7) == "L/m/config.pbtxt"
    assert version_key("r/model_repository/README", "r/model_repository", "L", 7) is None


@pytest.mark.parametrize("target", ["tensorrt"])
def test_gpu_targets_refuse_reload_at_plan_in_one_line(target):
    spec = parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "bkt"},
                       "target": target, "gpus": {"type": "h100-80gb", "count": 1},
                       "quantization": {"format": "fp8"}, "deploy": {"rollout": "reload"}})
    with pytest.raises(PlanRefused) as err:
        targets.get(target).check_model(spec, known("meta-llama/Meta-Llama-3-8B-Instruct"))
    text = str(err.value)
    assert "\n" not in text and text.startswith("deploy.rollout: reload") and "use deploy.rollout: replace" in text
