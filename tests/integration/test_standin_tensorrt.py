"""`target: tensorrt` end to end on the STAND-IN (STOKER_STANDIN=1): real Hub mirror, S3, Docker, Triton, Prefect.

STAND-IN, NOT TensorRT-LLM: the engine build is the reference path's and the serving image is the CPU Triton with
stoker's reference model installed as the backend `tensorrtllm`. Everything else is the GPU target's own code: the
inflight_batcher_llm repository as rendered (checked byte for byte inside the backend), upload, the one serving
path (stage, gates, switch, watch, retire), the plan and the manifest, which say the stand-in ran. This proves
stoker around the engine, never the engine.
"""

from __future__ import annotations

import copy
import shutil
import socket
import time
from pathlib import Path

import boto3
import openai
import pytest
import requests
import yaml
from operate_helpers import free_base_port, manifest_of, stoker, stoker_env
from standin_kit import RANK_PIDS, gpu_spec_data, rank_commands, rank_pids

from stoker import targets
from stoker.containers import engine
from stoker.containers.ports import Ports
from stoker.serving import probe
from stoker.spec.load import parse_spec

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

    _tensor_parallel_2_runs_a_process_per_rank(client, spec_data, packaged)

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


def _tensor_parallel_2_runs_a_process_per_rank(client, spec_data: dict, repository: Path) -> None:
    """tensor_parallel 2 on the stand-in (issue 48): the backend the GPU target renders (image, mounts, the product's
    serve_command: mpirun, one tritonserver per rank) over the first run's repository; ranks are processes, as under
    Open MPI. Rank 0 serves; rank 1 waits in the worker loop, never binding a port; a dead rank ends the job non-zero
    and the promoted backend's restart policy brings both ranks back. The ledger's admission is left out: GPU 0 is
    the live backend's, and this checks the processes, not the memory (the ledger's own tests do that)."""
    data = copy.deepcopy(spec_data)
    data["parallel"] = {"tensor": 2}
    spec = parse_spec(data)
    fields = targets.get("tensorrt").backend(spec, str(repository), (0, 1), standin_ran=True)
    fields.pop("admit")
    name = f"{spec.deploy.name}-tp2"
    backend = engine.BackendSpec(name=name, repo_digest="tp2", **fields)
    base = free_base_port()
    ports = Ports(http=base, grpc=base + 1, metrics=base + 2)
    url = f"http://127.0.0.1:{ports.http}"
    c = engine.start_backend(client, backend, "blue", ports)
    try:
        assert [c.attrs["Path"], *c.attrs["Args"][:3]] == ["mpirun", "--allow-run-as-root", "-n", "1"]
        probe.wait_ready(f"{url}/v2/health/ready", 150, exit_reason=lambda: engine.exit_reason(c))
        ranks = rank_pids(c)
        assert sorted(ranks) == [0, 1], ranks  # two tritonserver processes, OMPI_COMM_WORLD_RANK 0 and 1
        servers = rank_commands(c, ranks)
        # As upstream's launch_triton_server.py: every rank a tritonserver with its own shared-memory prefix; rank 0
        # loads the whole repository, the others only tensorrt_llm.
        assert all(cmd.startswith("tritonserver --model-repository=") and f"shm-region-prefix-name=prefix{r}_" in cmd
                   for r, cmd in servers.items()), servers
        assert [r for r, cmd in sorted(servers.items()) if "--load-model=tensorrt_llm" in cmd] == [1], servers
        answer = requests.post(f"{url}/v2/models/ensemble/generate", json={"text_input": "Hello", "max_tokens": 4},
                               timeout=60)
        assert answer.status_code == 200 and answer.json()["text_output"], answer.text
        logs = c.logs().decode()
        assert "STAND-IN rank 1 of 2: in the worker loop" in logs and logs.count("Started HTTPService") == 1

        engine.keep_running(c)  # as promotion does: Docker restarts the backend when its command exits non-zero
        killed_at = int(time.time())
        killed = c.exec_run(["python3", "-c", f"{RANK_PIDS}\nimport os\nos.kill(ranks()[1], 9)"])
        assert killed.exit_code == 0, killed.output
        with pytest.raises(probe.ProbeFailed, match="was ready, then"):  # the settle window's watch sees it
            probe.hold_ready(f"{url}/v2/health/ready", 60, exit_reason=lambda: engine.exit_reason(c))
        deadline = time.monotonic() + 60
        while int(c.attrs.get("RestartCount") or 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
            c.reload()
        assert int(c.attrs["RestartCount"]) >= 1 and engine.exit_reason(c) is not None, c.attrs["State"]
        # The exit status Docker saw (State.ExitCode reads 0 again once the restarted container runs).
        died = client.events(since=killed_at, until=int(time.time()) + 1, decode=True,
                             filters={"container": c.id, "event": "die"})
        assert [e["Actor"]["Attributes"]["exitCode"] for e in died][:1] == ["137"]
        assert "rank 1 (pid " in c.logs().decode() and "exited with status 137; terminating the job" in \
            c.logs().decode()
        deadline = time.monotonic() + 30  # both ranks start again (readiness is the first wait's, not redone)
        while time.monotonic() < deadline and sorted(rank_pids(c)) != [0, 1]:
            time.sleep(0.5)
        assert sorted(rank_pids(c)) == [0, 1]
    finally:
        engine.remove_deployment(client, name, lambda _m: None)


def _one_line_error(r, expected: str) -> None:
    assert r.returncode == 1 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
        r.stdout[-2000:] + r.stderr[-2000:]
