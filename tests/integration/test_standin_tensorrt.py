"""`target: tensorrt` end to end on the STAND-IN (STOKER_STANDIN=1): real Hub mirror, S3, Docker, Triton, Prefect.

STAND-IN, NOT TensorRT-LLM: the engine build is the reference path's and the serving image is the CPU Triton with
stoker's reference model installed as the backend `tensorrtllm`. Everything else is the GPU target's own code: the
inflight_batcher_llm repository as rendered (checked byte for byte inside the backend), upload, the one serving
path (stage, gates, switch, watch, retire), the plan and the manifest, which say the stand-in ran. This proves
stoker around the engine, never the engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from operate_helpers import free_base_port

from stoker.containers import engine
from stoker.demo import DEMO_SPEC

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def spec_data(local_stack, standin_image):
    data = yaml.safe_load(DEMO_SPEC.read_text())
    base = free_base_port()
    data.update(target="tensorrt", gpus={"type": "h100-80gb", "count": 2, "rollout": "surge"})
    data["model"]["endpoint"] = local_stack["hub"]
    data["storage"].update(endpoint_url=local_stack["s3"], bucket=f"sti-{uuid.uuid4().hex[:8]}")
    data["deploy"].update(name=f"sti-{uuid.uuid4().hex[:6]}", ports={"http": base, "grpc": base + 1,
                                                                      "metrics": base + 2},
                          image="nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3",  # what the stand-in replaces
                          settle_s=1, watch_s=3, openai=False)
    data["benchmark"].update({"concurrency": [1], "requests_per_level": 4, "output_tokens": 8})
    data["evaluation"] = {"enabled": False}
    yield data
    engine.remove_deployment(engine.connect(), data["deploy"]["name"], lambda _m: None)


def _stoker(args, env, timeout=1200):
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _env(tmp_path, local_stack, standin: bool = True):
    env = {**os.environ, **local_stack["aws_env"], "STOKER_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect")}
    if standin:
        env["STOKER_STANDIN"] = "1"
    return env


def _manifest(result) -> dict:
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("manifest: "), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(Path(last.removeprefix("manifest: ")).read_text())


def test_a_tensorrt_spec_runs_end_to_end_on_the_standin_and_a_rebuild_switches_gpu_sets(tmp_path, local_stack,
                                                                                       spec_data):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data))
    env = _env(tmp_path, local_stack)

    plan = _stoker(["plan", str(path)], env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "STAND-IN" in plan.stdout, plan.stdout

    first = _stoker(["run", str(path)], env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    m1 = _manifest(first)
    assert m1["status"] == "completed" and m1["standin"]["ran"] is True
    assert m1["steps"]["switch"]["status"] == "completed"
    client = engine.connect()
    [backend] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend.labels["ai.stoker.gpu.standin"] == "true" and backend.labels["ai.stoker.gpus"] == "0"
    assert backend.image.tags == ["stoker/triton-standin:2.51.0-cpu"]
    # The repository rendered for TensorRT-LLM's backend, mounted as the package step wrote it: its config is
    # byte for byte what stoker rendered (backend tensorrtllm, gpt_model_path and all).
    packaged = Path(m1["steps"]["deploy"]["detail"]["repository_uri"])  # the package step's folder, mounted
    inside = backend.exec_run(["cat", "/models/tensorrt_llm/config.pbtxt"]).output.decode()
    assert 'backend: "tensorrtllm"' in inside and "/models/tensorrt_llm/1/engine" in inside
    assert inside == (packaged / "tensorrt_llm" / "config.pbtxt").read_text()
    assert m1["steps"]["deploy"]["detail"]["image"] == "stoker/triton-standin:2.51.0-cpu"

    # A rebuild (another format): staged on the other GPU set (surge), gated, switched; one backend after.
    spec_data["quantization"]["format"] = "int4_awq"
    path.write_text(yaml.safe_dump(spec_data))
    second = _stoker(["run", str(path)], env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    m2 = _manifest(second)
    assert m2["status"] == "completed" and m2["steps"]["switch"]["status"] == "completed"
    [backend2] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend2.labels["ai.stoker.gpus"] == "1" and backend2.id != backend.id

    # `stoker rollback`: the first run's build again, staged from the folder its backend mounted, on the GPU set
    # the live backend does not hold, switched through the same proxy.
    back = _stoker(["rollback", spec_data["deploy"]["name"]], env, timeout=600)
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    [backend3] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend3.labels[engine.LABEL_DIGEST] == m1["steps"]["deploy"]["digest"]
    assert backend3.labels["ai.stoker.gpus"] == "0" and backend3.labels["ai.stoker.gpu.standin"] == "true"
    shown = _stoker(["status", spec_data["deploy"]["name"]], env, timeout=120)
    assert shown.returncode == 0 and "GPUs 0 STAND-IN (not TensorRT-LLM)" in shown.stdout, shown.stdout
