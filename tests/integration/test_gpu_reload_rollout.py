"""A GPU `reload` rollout (the plan's choice when two engines do not fit), on the STAND-IN, real Docker/HAProxy/Triton.

STAND-IN, NOT TensorRT-LLM: the backends are those `target: tensorrt` supplies under STOKER_STANDIN=1, serving the
promotion tests' scripted models from a mounted folder. What is real is the order stoker/deploy/rollout.py runs: the live
backend drains and stops (kept) before the candidate starts, the gap is measured, and every failure starts the
stopped backend again so the old build serves.
"""

from __future__ import annotations

import uuid

import pytest

from stoker.containers import engine
from stoker.deploy import rollout
from stoker.spec.load import parse_spec

from promotion_kit import Lines, generate, listen_ports
from serving_models import repo_digest, write_repo

pytestmark = [pytest.mark.docker]


@pytest.fixture
def gpu_spec(standin_image):
    ports = listen_ports()
    name = f"gr{uuid.uuid4().hex[:6]}"
    spec = parse_spec({"model": {"repo_id": "meta-llama/Meta-Llama-3-8B-Instruct"}, "storage": {"bucket": "unused"},
                       "target": "tensorrt", "gpus": {"type": "h100-80gb", "count": 1, "rollout": "reload"},
                       "deploy": {"name": name, "image": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3",
                                  "ports": {"http": ports.http, "grpc": ports.grpc, "metrics": ports.metrics},
                                  "settle_s": 0.5, "watch_s": 1, "ready_timeout_s": 60, "drain_timeout_s": 10,
                                  "openai": False}})
    yield spec
    engine.remove_deployment(engine.connect(), name, lambda _l: None)


def _deploy(spec, tmp_path, tag, **model) -> dict:
    root = write_repo(tmp_path / f"{tag}-{uuid.uuid4().hex[:6]}", tag, **model)
    log = Lines()
    staged = rollout.stage(spec, str(root), repo_digest(root), f"run-{tag}", log, standin=True)  # as a run records it
    return staged, log


def _serving(spec) -> str:
    return generate(f"http://127.0.0.1:{spec.deploy.ports.http}").split(":")[0]


def _backends(spec) -> list:
    return [c for c in engine.containers(engine.connect(), spec.deploy.name, role=engine.ROLE_BACKEND)]


def test_reload_stops_the_old_backend_first_measures_the_gap_and_restarts_it_on_every_failure(gpu_spec, tmp_path):
    staged, _ = _deploy(gpu_spec, tmp_path, "A")
    assert staged["gpu_rollout"] == {"choice": "reload", "expected_gap_s": staged["gpu_rollout"]["expected_gap_s"]}
    rollout.go_live(gpu_spec, staged, Lines())  # the first backend: nothing to stop
    assert _serving(gpu_spec) == "A"

    staged, log = _deploy(gpu_spec, tmp_path, "B")
    assert any("stopped (kept" in line for line in log), log
    # While the candidate is staged, the old backend is stopped: one running backend, the candidate.
    assert [c.status for c in _backends(gpu_spec)].count("running") == 1
    done = rollout.go_live(gpu_spec, staged, Lines())
    assert 0 < done["gap_s"] < 120 and _serving(gpu_spec) == "B"
    assert len(_backends(gpu_spec)) == 1  # the stopped one is removed after the watch window

    # A candidate that never gets ready: removed, and the stopped backend starts again and serves.
    spec_fast = gpu_spec.model_copy(update={"deploy": gpu_spec.deploy.model_copy(update={"ready_timeout_s": 8})})
    with pytest.raises(engine.NotReady):
        _deploy(spec_fast, tmp_path, "C", mode="hang")
    assert _serving(gpu_spec) == "B" and len(_backends(gpu_spec)) == 1

    # A candidate that fails a gate (abandoned before the switch): the same way back.
    staged, _ = _deploy(gpu_spec, tmp_path, "D")
    assert "started again" in rollout.abandon(gpu_spec, staged, Lines())
    assert _serving(gpu_spec) == "B" and len(_backends(gpu_spec)) == 1
