"""Shared pieces of the test_operate_* modules: a real Prefect server (+ worker) on loopback, specs, ports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def free_base_port() -> int:
    """A port p with p..p+2 (and p+10..p+12, kept free for older callers) all free, below the ephemeral range, each
    leased (stoker/containers/port_lease.py): no other pick of this host takes them before the proxy binds them."""
    from stoker.containers import port_lease
    from stoker.stack.services import free_port

    for _ in range(200):
        base = free_port()
        rest = (1, 2, 10, 11, 12)
        if all(_free(base + i) and not port_lease.held(base + i) for i in rest):
            if all(port_lease.claim(base + i) for i in rest):
                return base
    raise RuntimeError("no free port range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False



# build_and_deploy in a child process: argv[1] the spec's JSON, argv[2] its source name; prints one RESULT or FAILED
# line (JSON) for the caller to parse.
RUN_FLOW = r"""
import json, sys, time
from flows.build_and_deploy import build_and_deploy
from stoker.spec.load import parse_spec
spec = parse_spec(json.loads(sys.argv[1]), sys.argv[2])
t0 = time.monotonic()
try:
    m = build_and_deploy(spec)
    print("RESULT " + json.dumps({"manifest": m, "s": time.monotonic() - t0}))
except Exception as exc:
    print("FAILED " + json.dumps({"error": f"{type(exc).__name__}: {exc}", "s": time.monotonic() - t0}))
"""

def make_spec(local_stack, name: str, **deploy) -> dict:
    """The demo spec on the local stack, quantization off (the fastest real build), small benchmark."""
    from stoker.demo import DEMO_SPEC

    data = yaml.safe_load(DEMO_SPEC.read_text())
    base = free_base_port()
    data["model"]["endpoint"] = local_stack["hub"]
    data["quantization"] = {"format": "none"}
    data.pop("adapters")  # test_lora_served and test_flow serve adapters; these tests prove other mechanics
    data["storage"].update(endpoint_url=local_stack["s3"], bucket=f"it-{uuid.uuid4().hex[:8]}")
    # Short windows: these tests prove the mechanics, not a 30 s production watch.
    data["deploy"] = {"name": name, "ports": {"http": base, "grpc": base + 1, "metrics": base + 2},
                      "settle_s": 1, "watch_s": 2, **deploy}
    data["benchmark"].update({"concurrency": [1], "requests_per_level": 2, "output_tokens": 8, "warmup_requests": 1})
    return data


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """`prefect server start` (SQLite) with basic auth on a free loopback port; stopped after the module."""
    from stoker.stack.prefect_stack import ensure_server
    from stoker.stack.services import stop_all

    state = tmp_path_factory.mktemp("prefect-stack")
    api = ensure_server(state)
    yield api, state
    stop_all(state)


def prefect_env(api) -> dict[str, str]:
    return {**os.environ, **api.env()}


def stoker_env(tmp_path: Path, api_url: str, local_stack: dict | None = None, standin: bool = False) -> dict:
    """The environment of a `stoker` process a test starts: homes of its own under ``tmp_path``, the local stack's
    S3 credentials, and ``api_url``, the test process's Prefect API (tests/conftest.py worker_prefect_api): each
    process starting a temporary API of its own would cost more than most checks under test."""
    env = {**os.environ, **(local_stack or {}).get("aws_env", {}), "STOKER_HOME": str(tmp_path / "home"),
           "PREFECT_HOME": str(tmp_path / "prefect"), "HF_HOME": str(tmp_path / "hf"), "PREFECT_API_URL": api_url}
    if standin:
        env["STOKER_STANDIN"] = "1"
    return env


def stoker(args: list[str], env: dict | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    """`stoker ARGS` as a user runs it: a new process from the checkout, output captured; ``env`` None inherits this
    process's environment (tests/conftest.py gives each test its own STOKER_HOME there)."""
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def manifest_of(result: subprocess.CompletedProcess) -> dict:
    """The run manifest a `stoker run` printed the path of, last."""
    last = (result.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("manifest: "), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(Path(last.removeprefix("manifest: ")).read_text())


def run_py(code: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def apply_deployments(tmp_path: Path, api, pool: str) -> subprocess.CompletedProcess:
    """`stoker deploy-flows` in a new process against the test server: a process pool `pool` and a
    build_and_deploy deployment named after it, in a prefect.yaml with the repo's own build and pull steps."""
    repo = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    platform, prefect_file = tmp_path / "platform.yaml", tmp_path / "prefect.yaml"
    platform.write_text(yaml.safe_dump({"work_pools": [{"name": pool}]}))
    deployment = {"name": pool, "entrypoint": "flows/build_and_deploy.py:build_and_deploy", "work_pool": {"name": pool}}
    prefect_file.write_text(yaml.safe_dump({"build": repo["build"], "pull": repo["pull"], "deployments": [deployment]}))
    return subprocess.run([sys.executable, "-m", "stoker.cli", "deploy-flows", "--platform", str(platform),
                           "--prefect-file", str(prefect_file)], cwd=ROOT, env=prefect_env(api),
                          capture_output=True, text=True, timeout=300)


def api_get(api, path: str, body: dict | None = None) -> dict | list:
    """A raw read of the Prefect REST API with basic auth (POST when body is given: every caller's body is a filter,
    so a call is safe to repeat)."""
    import base64

    req = urllib.request.Request(f"{api.url}{path}", data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": "Basic " + base64.b64encode(api.auth.encode()).decode(),
                                          "Content-Type": "application/json"})
    return json.loads(_prefect_call(req)[1] or b"null")


def _prefect_call(req: urllib.request.Request, attempts: int = 4) -> tuple[int, bytes]:
    """(status, body) of a request to the Prefect API that is safe to repeat, repeated as Prefect's own client
    repeats it. Prefect's SQLite server lets a write wait up to 60 s for the database lock (its PRAGMA
    busy_timeout), and on a loaded 2-core machine, with a flow run streaming logs to it, a read took over 30 s once
    and failed CI: the client waits longer than the server may, and asks again after a timeout. A request that
    meets a locked database is answered 503 (prefect/server/api/server.py, is_client_retryable_exception), which
    Prefect's client retries with a backoff (prefect/client/base.py; a PATCH of a pool's limit failed CI on it)."""
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(req, timeout=75) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            if err.code != 503 or attempt == attempts:
                raise
        except TimeoutError:
            if attempt == attempts:
                raise
        time.sleep(2 ** attempt)
    raise AssertionError("unreachable")


def flow_runs(api, deployment_id: str) -> list[dict]:
    return api_get(api, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}})


def deployment_id(api, flow: str, name: str) -> str:
    return api_get(api, f"/deployments/name/{flow}/{name}")["id"]


def wait_final(api, run_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        run = api_get(api, f"/flow_runs/{run_id}")
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"flow run {run_id} still {run['state']['type']} after {timeout_s} s")
        time.sleep(1)


def record(key: str, value) -> None:
    """Add a measurement to $STOKER_OPERATE_OUT (JSON), which benchmarks/operate.py sets; no-op otherwise."""
    out = os.environ.get("STOKER_OPERATE_OUT")
    if not out:
        return
    path = Path(out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def wait_online(api, pool: str, timeout_s: float = 120) -> None:
    """Until a worker of ``pool`` heartbeats as ONLINE (a started worker registers on its first poll)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(w["status"] == "ONLINE" for w in api_get(api, f"/work_pools/{pool}/workers/filter", {})):
            return
        time.sleep(1)
    raise AssertionError(f"no worker of {pool} came online in {timeout_s:g} s")


def set_pool_limit(api, pool: str, limit: int) -> None:
    """The work pool's concurrency limit (0: its workers take nothing, so started runs stay Scheduled)."""
    import base64

    req = urllib.request.Request(f"{api.url}/work_pools/{pool}", method="PATCH",
                                 data=json.dumps({"concurrency_limit": limit}).encode(),
                                 headers={"Authorization": "Basic " + base64.b64encode(api.auth.encode()).decode(),
                                          "Content-Type": "application/json"})
    assert _prefect_call(req)[0] == 204
