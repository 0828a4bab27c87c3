"""`target: pytorch` end to end on the STAND-IN (STOKER_STANDIN=1): real Hub mirror, S3, Docker, Triton, Prefect.

STAND-IN, NOT TensorRT-LLM: the build is the reference path's and the serving image is the CPU Triton whose
/app/all_models/llmapi holds a model with the contract of TensorRT-LLM's LLM-API model (stoker/triton/models/llmapi.py)
where stoker's shim looks for upstream's. Everything else is the LLM-API target's own code: the llmapi repository as
rendered (config.pbtxt, model.yaml and the shim, served unchanged), upload, the one serving path (stage, smoke,
benchmark, switch, watch, retire) speaking the LLM API's interface, rollback, the plan and the manifest, which say
the stand-in ran. This proves stoker around the LLM API, never the LLM API.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml
from operate_helpers import manifest_of, stoker, stoker_env
from standin_kit import gpu_spec_data

from stoker.containers import engine
from stoker.protocol import LLMAPI

# 1,500 s: the end-to-end run took 757 s in ci75's parallel tier and ran past the default 900 s in ci77's.
pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow,
              pytest.mark.timeout(1500)]


@pytest.fixture
def spec_data(local_stack, standin_image):
    data = gpu_spec_data(local_stack, "pytorch", "stp", openai=True)
    data["quantization"]["format"] = "int4_awq"
    data["evaluation"] = {"enabled": True, "prompts": 4, "greedy_tokens": 8}
    yield data
    engine.remove_deployment(engine.connect(), data["deploy"]["name"], lambda _m: None)


def test_a_pytorch_spec_runs_end_to_end_on_the_standin_and_rolls_back(tmp_path, local_stack, spec_data,
                                                                       worker_prefect_api):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data))
    env = stoker_env(tmp_path, worker_prefect_api, local_stack, standin=True)

    plan = stoker(["plan", str(path)], env)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "STAND-IN" in plan.stdout, plan.stdout

    first = stoker(["run", str(path)], env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    m1 = manifest_of(first)
    assert m1["status"] == "completed" and m1["standin"]["ran"] is True
    assert m1["steps"]["switch"]["status"] == "completed"
    # No bf16 baseline was recorded for these weights: the run recorded it first (the none build, staged, scored
    # through the LLM API's text interface, removed), then judged the int4_awq candidate against it.
    for step in ("bf16-build", "bf16-package", "bf16-upload", "bf16-deploy", "bf16-evaluate", "bf16-remove"):
        assert m1["steps"][step]["status"] == "completed", step
    assert m1["evaluation"]["passed"] is True
    agreement = next(r for r in m1["evaluation"]["rows"] if r["metric"] == "greedy agreement")
    assert 0 < agreement["candidate"] <= 1
    [level] = m1["benchmark"]["levels"]
    assert level["completed"] == 4 and level["errors"] == 0  # measured through the LLM API's inputs
    client = engine.connect()
    [backend] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend.labels["ai.stoker.gpu.standin"] == "true" and backend.labels[engine.LABEL_INTERFACE] == "llmapi"
    assert backend.image.tags == ["stoker/triton-standin:2.51.0-cpu"]
    # The llmapi repository as rendered, served unchanged: model.yaml names the mounted checkpoint, model.py is
    # stoker's shim, which loaded the model it found at TensorRT-LLM's path in the image.
    packaged = Path(m1["steps"]["deploy"]["detail"]["repository_uri"])
    for rel in ("tensorrt_llm/config.pbtxt", "tensorrt_llm/1/model.yaml", "tensorrt_llm/1/model.py"):
        assert backend.exec_run(["cat", f"/models/{rel}"]).output.decode() == (packaged / rel).read_text(), rel
    assert "/models/tensorrt_llm/1/checkpoint" in (packaged / "tensorrt_llm/1/model.yaml").read_text()
    logs = backend.logs().decode(errors="replace")
    assert "llmapi STAND-IN" in logs

    # Through the stable address, with the LLM API's inputs: the answer is the whole output so far.
    base = f"http://127.0.0.1:{spec_data['deploy']['ports']['http']}"
    body = json.dumps(LLMAPI.request("Hello", 6, streaming=False)).encode()
    req = urllib.request.Request(f"{base}/v2/models/tensorrt_llm/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert answer["text_output"] and answer["finish_reason"] in ("length", "stop")
    # The OpenAI API at the same address: stoker's service, speaking the LLM API's interface to the live backend.
    api = openai.OpenAI(base_url=m1["endpoint"]["openai"], api_key="unused", max_retries=0, timeout=60)
    done = api.completions.create(model=spec_data["deploy"]["name"], prompt="Hello", max_tokens=6, temperature=0)
    assert done.choices[0].text == answer["text_output"] and done.choices[0].finish_reason == answer["finish_reason"]
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=spec_data["deploy"]["name"], prompt="Hello", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == answer["text_output"]

    # A rebuild (another format): staged on the other GPU set (surge), smoke-tested, judged against the baseline
    # recorded by the first run (no second bf16 run), switched.
    spec_data["quantization"]["format"] = "w4a8_awq"
    path.write_text(yaml.safe_dump(spec_data))
    second = stoker(["run", str(path)], env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    m2 = manifest_of(second)
    assert m2["status"] == "completed" and m2["steps"]["switch"]["status"] == "completed"
    assert not any(name.startswith("bf16-") for name in m2["steps"]) and m2["evaluation"]["passed"] is True
    [backend2] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend2.labels["ai.stoker.gpus"] == "1" and backend2.id != backend.id

    back = stoker(["rollback", spec_data["deploy"]["name"]], env, timeout=600)
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    [backend3] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend3.labels[engine.LABEL_DIGEST] == m1["steps"]["deploy"]["digest"]
    assert backend3.labels[engine.LABEL_INTERFACE] == "llmapi" and backend3.labels["ai.stoker.gpus"] == "0"
