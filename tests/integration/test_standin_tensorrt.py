"""`target: tensorrt` end to end on the STAND-IN (STOKER_STANDIN=1): real Hub mirror, S3, Docker, Triton, Prefect.

STAND-IN, NOT TensorRT-LLM: the engine build is the reference path's and the serving image is the CPU Triton with
stoker's reference model installed as the backend `tensorrtllm`. Everything else is the GPU target's own code: the
inflight_batcher_llm repository as rendered (checked byte for byte inside the backend), upload, the one serving
path (stage, gates, switch, watch, retire), the plan and the manifest, which say the stand-in ran. This proves
stoker around the engine, never the engine.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import boto3
import openai
import pytest
import yaml
from operate_helpers import manifest_of, stoker, stoker_env
from standin_kit import gpu_spec_data

from stoker.containers import engine

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def spec_data(local_stack, standin_image):
    data = gpu_spec_data(local_stack, "tensorrt", "sti", openai=True)
    data["build"] = {"max_input_len": 24}  # below the model's context: the deployed limit, not the model's, applies
    data["benchmark"]["input_tokens"] = 16  # within it
    data["evaluation"] = {"enabled": False}
    yield data
    engine.remove_deployment(engine.connect(), data["deploy"]["name"], lambda _m: None)


def test_a_tensorrt_spec_runs_end_to_end_on_the_standin_and_a_rebuild_switches_gpu_sets(tmp_path, local_stack,
                                                                                       spec_data, worker_prefect_api):
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
    # The engine folder holds what trtllm-build writes, no tokenizer; /v1 finds preprocessing's (a 503 once).
    assert not list((packaged / "tensorrt_llm" / "1" / "engine").glob("tokenizer*"))
    api = openai.OpenAI(base_url=m1["endpoint"]["openai"], api_key="unused", max_retries=0, timeout=60)
    done = api.chat.completions.create(model=spec_data["deploy"]["name"], max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "Hello"}])
    assert done.choices[0].message.content and done.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="at most 24 tokens"):  # build.max_input_len, not the context
        api.completions.create(model=spec_data["deploy"]["name"], prompt="word " * 40, max_tokens=4)

    # The GPU memory ledger (STAND-IN): the backend holds its engine and a KV cache sized from what was free.
    from stoker.gpu.standin_ledger import LABEL_BYTES

    assert int(backend.labels[LABEL_BYTES]) > 0.5 * 80 * 2**30
    # Something else holds GPU 1, where the rebuild would run: the build is refused as CUDA would refuse it, with
    # the numbers, before any heavy step; the live backend keeps serving.
    spec_data["quantization"]["format"] = "int4_awq"
    path.write_text(yaml.safe_dump(spec_data))
    hog = client.containers.run("stoker/triton-cpu:2.51.0-cpu", ["sleep", "300"], detach=True, entrypoint="",
                                name=f"{spec_data['deploy']['name']}-hog", labels={
                                    engine.LABEL_MANAGED: "true", engine.LABEL_DEPLOYMENT: spec_data["deploy"]["name"],
                                    engine.LABEL_ROLE: "hold", "ai.stoker.gpus": "1", LABEL_BYTES: str(80 * 2**30)})
    try:
        refused = stoker(["run", str(path)], env)
    finally:
        hog.remove(force=True)
    assert refused.returncode != 0
    out = refused.stdout + refused.stderr
    assert "CUDA out of memory (STAND-IN ledger): the build (quantize, build) needs ~" in out, out[-3000:]
    assert "on GPU 1, which has ~0.0 GiB free of 79.6 GiB" in out, out[-3000:]
    backend.reload()
    assert backend.status == "running"

    # A rebuild (another format): staged on the other GPU set (surge), gated, switched; one backend after.
    second = stoker(["run", str(path)], env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    m2 = manifest_of(second)
    assert m2["status"] == "completed" and m2["steps"]["switch"]["status"] == "completed"
    [backend2] = engine.containers(client, spec_data["deploy"]["name"], role=engine.ROLE_BACKEND)
    assert backend2.labels["ai.stoker.gpus"] == "1" and backend2.id != backend.id
    # Each run decided its GPUs once, after the fetch, from the fetched files: the candidate (and its build) on
    # the set the live backend did not hold; the decision is in the manifest.
    d1, d2 = m1["steps"]["gpu-rollout"]["detail"], m2["steps"]["gpu-rollout"]["detail"]
    assert (d1["facts"], d1["rollout"]["choice"], d1["held"], d1["candidate"]) == ("fetched files", "surge", [], [0])
    assert (d2["held"], d2["candidate"]) == ([0], [1])

    # `stoker rollback` after this host lost what it had (issue 48: "rollback reads S3"): the first run's package
    # folder pruned from the step cache (as `stoker cache prune` removes it) and every local manifest. The history
    # comes from the run manifests in S3, the repository from the first run's upload, verified and renamed into
    # place; bad input on the way is one line each, and the build that serves stays.
    name, st = spec_data["deploy"]["name"], spec_data["storage"]
    home = Path(env["STOKER_HOME"]).resolve()
    u1, u2 = m1["steps"]["upload"]["digest"], m2["steps"]["upload"]["digest"]
    shutil.rmtree(packaged.parent)
    shutil.rmtree(home / "runs")
    _one_line_error(stoker(["rollback", name], env, timeout=300), "pass --spec SPEC")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    unreachable = tmp_path / "unreachable.yaml"
    unreachable.write_text(yaml.safe_dump({**spec_data, "storage": {**st, "endpoint_url": closed}}))
    _one_line_error(stoker(["rollback", name, "--spec", str(unreachable)], {**env, "AWS_MAX_ATTEMPTS": "1"},
                           timeout=300), f"{closed} is unreachable")
    # The first upload tampered with: a file of the same size with other bytes, which the marker's sizes let pass.
    s3c = boto3.client("s3", endpoint_url=st["endpoint_url"], region_name="us-east-1", **{
        k.lower(): v for k, v in local_stack["aws_env"].items() if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    key = f"{st['prefix']}/repos/{u1[:24]}/model_repository/tensorrt_llm/config.pbtxt"
    original = s3c.get_object(Bucket=st["bucket"], Key=key)["Body"].read()
    s3c.put_object(Bucket=st["bucket"], Key=key, Body=original.replace(b"tensorrtllm", b"TENSORRTLLM"))
    _one_line_error(stoker(["rollback", name, "--spec", str(path)], env, timeout=300), "digest mismatch")
    s3c.put_object(Bucket=st["bucket"], Key=key, Body=original)
    [live] = engine.containers(client, name, role=engine.ROLE_BACKEND)
    assert live.labels[engine.LABEL_DIGEST] == u2
    assert not list((home / "repos").glob("*"))  # no half copy left behind

    # The first run's build again, on the GPU set the live backend does not hold, switched through the same proxy.
    back = stoker(["rollback", name, "--spec", str(path)], env, timeout=600)
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    fetched = home / "repos" / u1[:24]
    assert f"downloaded from s3://{st['bucket']}/{st['prefix']}/repos/{u1[:24]}/model_repository into {fetched}" \
        in back.stdout, back.stdout
    [backend3] = engine.containers(client, name, role=engine.ROLE_BACKEND)
    assert backend3.labels[engine.LABEL_DIGEST] == m1["steps"]["deploy"]["digest"] == u1
    assert backend3.labels["ai.stoker.gpus"] == "0" and backend3.labels["ai.stoker.gpu.standin"] == "true"
    assert {m["Source"] for m in backend3.attrs["Mounts"] if m["Destination"] == "/models"} == {str(fetched)}
    assert backend3.exec_run(["cat", "/models/tensorrt_llm/config.pbtxt"]).output == original
    shown = stoker(["status", name], env, timeout=120)
    assert shown.returncode == 0 and "GPUs 0 STAND-IN (not TensorRT-LLM)" in shown.stdout, shown.stdout


def _one_line_error(r, expected: str) -> None:
    assert r.returncode == 1 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
        r.stdout[-2000:] + r.stderr[-2000:]
