"""The stand-in is a decision a run makes once, at its start, and records: what builds and serves reads the record,
never the environment of whoever runs the step later (a routed worker, a rollback from another shell)."""

from __future__ import annotations

import pytest

from stoker import targets
from stoker.errors import PlanRefused
from stoker.gpu import standin
from stoker.spec.load import parse_spec
from stoker.stack.standin_image import DEFAULT_STANDIN_IMAGE

NGC = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"


def _spec(target: str = "pytorch", **deploy) -> object:
    return parse_spec({"model": {"repo_id": "org/m"}, "storage": {"bucket": "bkt"}, "target": target,
                       "gpus": {"type": "h100-80gb", "count": 1}, "deploy": {"image": NGC, "openai": False, **deploy}})


def test_the_run_decides_from_the_environment_once(monkeypatch):
    monkeypatch.delenv(standin.ENV, raising=False)
    assert standin.decide(_spec()) is False
    monkeypatch.setenv(standin.ENV, "1")
    assert standin.decide(_spec("pytorch")) is True and standin.decide(_spec("tensorrt")) is True
    with pytest.raises(PlanRefused, match="deploy.listen 0.0.0.0"):
        standin.decide(_spec(listen="0.0.0.0", allow_unauthenticated=True))


@pytest.mark.parametrize("target", ["pytorch", "tensorrt"])
def test_backends_follow_the_record_not_the_environment(monkeypatch, target):
    monkeypatch.setenv(standin.ENV, "1")  # a worker's environment says stand-in ...
    real = targets.get(target).backend(_spec(target), "/host/repo", (0,), standin_ran=False)
    assert real["image"] == NGC and real["device_ids"] == (0,)  # ... but the run recorded a real GPU run
    monkeypatch.delenv(standin.ENV)
    stood = targets.get(target).backend(_spec(target), "/host/repo", (0,), standin_ran=True)
    assert stood["image"] == DEFAULT_STANDIN_IMAGE and stood["device_ids"] == ()
    assert stood["labels"]["ai.stoker.gpu.standin"] == "true" and stood["labels"]["ai.stoker.gpus"] == "0"


def test_a_recorded_stand_in_is_refused_for_an_endpoint_other_machines_reach():
    from stoker.deploy.rollout import backend_specs

    spec = _spec(listen="0.0.0.0", allow_unauthenticated=True)
    with pytest.raises(PlanRefused, match="recorded for this build"):
        backend_specs(spec, "/host/repo", "d" * 64, {}, "run", [(0,)], standin=True)
    assert backend_specs(spec, "/host/repo", "d" * 64, {}, "run", [(0,)], standin=False)[0].image == NGC


def test_the_standin_dockerfile_sets_the_label_its_build_is_checked_for():
    """A fresh build is refused unless the image carries STANDIN_LABEL (ensure_derived_image's check): the Dockerfile
    and the constant must name the same label (they drifted once, and every first build failed)."""
    from stoker.stack.standin_image import STANDIN_DIR, STANDIN_LABEL

    assert f'LABEL {STANDIN_LABEL}="true"' in (STANDIN_DIR / "Dockerfile").read_text()
