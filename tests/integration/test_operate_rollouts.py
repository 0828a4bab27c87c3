"""Rollouts on real servers (moto S3, olah, Docker + the CPU Triton image), under steady streamed load.

Two builds of the same model that differ only in their Triton config give two repository digests
(the second build is all cache hits up to package). Failed requests are counted for each strategy:
`reload` (new model version loaded in place; goal zero) and `replace` (new container on other ports;
the client follows the new endpoint once the rollout returns). Then the automatic rollback (deploy's
transaction hook after a failed later step) and `stoker rollback NAME`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from operate_helpers import ROOT, make_spec, record

from stoker import docker_engine, rollout, s3
from stoker.loadgen import SteadyLoad
from stoker.spec import parse_spec

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]
LOAD_S = 3.0  # steady load before and after each rollout


@pytest.fixture(scope="module")
def two_runs(local_stack, triton_image, tmp_path_factory):
    """`stoker run` of build A then build B (replace): manifests, specs, a shared STOKER_HOME."""
    tmp = tmp_path_factory.mktemp("rollouts")
    name = f"ro-{uuid.uuid4().hex[:6]}"
    a = make_spec(local_stack, name)
    a["triton"] = {"model_threads": 1}
    b = json.loads(json.dumps(a))
    b["triton"] = {"model_threads": 2}
    env = {**os.environ, **local_stack["aws_env"], "STOKER_HOME": str(tmp / "home"),
           "PREFECT_HOME": str(tmp / "prefect"), "HF_HOME": str(tmp / "hf")}
    env.pop("PREFECT_API_URL", None)
    manifests = []
    for label, data in (("a", a), ("b", b)):
        path = tmp / f"{label}.yaml"
        path.write_text(yaml.safe_dump(data))
        r = subprocess.run([sys.executable, "-m", "stoker.cli", "run", str(path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        last = r.stdout.strip().splitlines()[-1].removeprefix("manifest: ")
        manifests.append(json.loads(Path(last).read_text()))
    yield {"name": name, "specs": (a, b), "manifests": manifests, "env": env, "home": tmp / "home"}
    docker_engine.remove_deployment(docker_engine.connect(), name, lambda _m: None)


@pytest.fixture
def aws(monkeypatch, local_stack, two_runs):
    for k, v in local_stack["aws_env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("STOKER_HOME", str(two_runs["home"]))


def _spec(data: dict, strategy: str):
    return parse_spec({**data, "deploy": {**data["deploy"], "rollout": strategy}})


def _upload(m: dict) -> tuple[str, str]:
    up = m["steps"]["upload"]
    return up["detail"]["repository_uri"], up["digest"]


def _under_load(endpoint: dict, change) -> dict:
    load = SteadyLoad(endpoint=lambda: endpoint["http"]).start()
    time.sleep(LOAD_S)
    t0 = time.monotonic()
    done = change()
    took = time.monotonic() - t0
    endpoint["http"] = done["http"]  # a client that follows the new endpoint
    time.sleep(LOAD_S)
    return {**load.stop(), "rollout_s": round(took, 2), "done": done}


def test_manifests_record_the_rollout_and_metrics(two_runs):
    m_a, m_b = two_runs["manifests"]
    assert m_a["steps"]["upload"]["digest"] != m_b["steps"]["upload"]["digest"]
    assert m_b["rollout"]["strategy"] == "replace"
    assert m_b["rollout"]["previous"]["digest"] == m_a["steps"]["upload"]["digest"]
    rows = {r["model"]: r for r in m_b["triton_metrics"]}
    assert rows["ensemble"]["requests"] >= 3 and rows["tensorrt_llm"]["mean_compute_ms"] > 0
    assert rows["tensorrt_llm"]["mean_queue_ms"] is not None and rows["ensemble"]["failed"] == 0


def test_reload_and_replace_under_steady_load(two_runs, aws, capsys):
    (a, b), (m_a, m_b) = two_runs["specs"], two_runs["manifests"]
    log = lambda _m: None
    results = {}
    # replace: B serves now (replace); roll A out on the standby ports while requests flow.
    endpoint = {"http": m_b["endpoint"]["http"]}
    results["replace"] = _under_load(endpoint, lambda: rollout.rollout(_spec(a, "replace"), *_upload(m_a), log))
    assert results["replace"]["done"]["replaced"] and results["replace"]["requests"] > 0

    # reload: first switch to a reload container (explicit model control) serving A as version 1 ...
    first = rollout.rollout(_spec(a, "reload"), *_upload(m_a), log)
    assert first["version"] == 1
    # ... then B as version 2, loaded into the running server.
    endpoint = {"http": first["http"]}
    results["reload"] = _under_load(endpoint, lambda: rollout.rollout(_spec(b, "reload"), *_upload(m_b), log))
    done = results["reload"]["done"]
    assert done["version"] == 2 and done["container"] == first["container"] and done["http"] == first["http"]
    assert done["reused"] is False and done["load_s"] > 0
    with capsys.disabled():
        print("\nfailed requests during rollout:",
              {k: (v["failed_requests"], v["requests"], v["rollout_s"], v["errors"]) for k, v in results.items()})
    record("rollouts", {k: {f: v[f] for f in ("requests", "failed_requests", "rollout_s", "errors")}
                        for k, v in results.items()} | {"load": {"threads": 2, "max_tokens": 4,
                                                                 "steady_s_before_and_after": LOAD_S}})
    assert results["reload"]["requests"] > 5
    assert results["reload"]["failed_requests"] == 0, results["reload"]["errors"]

    # Rolling the reload back: version 2 dropped, version 1 (A) loaded again, same container.
    back = rollout.roll_back(_spec(b, "reload"), done, log)
    assert back["action"] == "reloaded version 1"
    s3c = s3.client(_spec(a, "reload").storage)
    assert rollout.read_live(s3c, _spec(a, "reload").storage, two_runs["name"])["digest"] == _upload(m_a)[1]


def test_stoker_rollback_cli_and_the_transaction_hook(two_runs, aws):
    (a, _b), (m_a, m_b) = two_runs["specs"], two_runs["manifests"]
    name = two_runs["name"]
    client = docker_engine.connect()
    # `stoker rollback NAME RUN_ID`: back to run B's repository, rolled out as run B's spec says (replace).
    r = subprocess.run([sys.executable, "-m", "stoker.cli", "rollback", name, m_b["run_id"]], cwd=ROOT,
                       env={**two_runs["env"]}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    now = rollout.serving(client, name)
    assert (now.strategy, now.digest) == ("replace", _upload(m_b)[1])

    # A failed step after deploy inside the transaction: the hook returns to B by itself.
    from prefect import flow, task
    from prefect.transactions import transaction

    from stoker.run import RunContext, StepResult
    from tasks.rollout import deploy_endpoint, read_rollback

    @task
    def failing_gate():
        raise RuntimeError("benchmark gate: p99 TTFT above the limit")

    ctx = RunContext.new(two_runs["home"])
    uri, digest = _upload(m_a)
    uploaded = StepResult(name="upload", digest=digest, detail={"repository_uri": uri})

    @flow
    def deploy_then_fail():
        with transaction():
            deploy_endpoint(_spec(a, "replace"), uploaded, ctx)
            failing_gate()

    with pytest.raises(RuntimeError, match="gate"):
        deploy_then_fail()
    record = read_rollback(ctx)
    assert record["status"] == "rolled back" and record["from"] == digest
    now = rollout.serving(client, name)
    assert (now.strategy, now.digest) == ("replace", _upload(m_b)[1])
