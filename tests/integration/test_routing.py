"""Heavy steps routed by resource, for real: a `prefect server start`, `stoker deploy-flows` (which creates the
docker pool stoker-gpu and registers heavy_steps/gpu), a prefect-docker 0.7.4 worker on that pool, and the
worker image (stoker + Prefect on the Triton CPU image, built here without a registry).

build_and_deploy runs in a process of its own with S3 keys only in a Prefect block; its fetch, quantize and build
run again in a container the docker worker starts (a run of heavy_steps/gpu), whose results come back through the
shared step cache. A spec routed to a pool with no worker, or to a deployment that does not exist, fails at
preflight in one line naming it; a routed run no worker starts is cancelled after routing.start_timeout_s.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from operate_helpers import ROOT, RUN_FLOW, api_get, make_spec, prefect_api, prefect_env, stoker, wait_online  # noqa: F401

from stoker.containers import engine as docker_engine

pytestmark = [pytest.mark.prefect, pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.slow]



@pytest.fixture(scope="module")
def fleet(prefect_api, local_stack, triton_image, tmp_path_factory):
    """Deployments and pools applied, the S3 block saved, the worker image built, a docker worker online."""
    from stoker.stack.prefect_stack import ensure_worker
    from stoker.stack.worker_image import ensure_worker_image

    api, state = prefect_api
    env = prefect_env(api)
    ensure_worker_image(log=lambda _l: None)
    r = stoker(["deploy-flows"], env=env, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    code = f"from stoker.stack.s3server import save_local_block; save_local_block({local_stack['s3']!r})"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    ensure_worker(state, api, "stoker-gpu", cwd=ROOT, type_="docker")
    wait_online(api, "stoker-gpu")
    return api, env, tmp_path_factory.mktemp("routing")


def _spec(local_stack, name: str, heavy: str, fmt: str = "fp8") -> dict:
    data = make_spec(local_stack, name)
    data["quantization"] = {"format": fmt, "calibration": {"samples": 4, "seq_len": 32, "batch_size": 4}}
    data["storage"].update(shared_cache=True, credentials_block="stoker-local-s3", create_bucket=True)
    data["evaluation"] = {"enabled": False}
    # 180 s: in ci77's loaded tier (load average ~10 on 2 cores) a docker worker did not start its run within 60 s.
    data["routing"] = {"heavy": heavy, "start_timeout_s": 180}
    return data


def _run(data: dict, env: dict, home: Path, timeout: float = 600) -> dict:
    # No AWS keys in this process either: the block is the only source, as on any worker.
    clean = {k: v for k, v in env.items() if not k.startswith("AWS_")} | {"STOKER_HOME": str(home)}
    r = subprocess.run([sys.executable, "-c", RUN_FLOW, json.dumps(data), "it"], cwd=ROOT, env=clean, capture_output=True,
                       text=True, timeout=timeout)
    for tag in ("RESULT ", "FAILED "):
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith(tag)), None)
        if line:
            return {"ok": tag == "RESULT ", **json.loads(line.removeprefix(tag)), "log": r.stdout + r.stderr}
    raise AssertionError((r.stdout + r.stderr)[-4000:])


def test_quantize_and_build_run_in_a_docker_worker_container_and_come_back_through_the_cache(fleet, local_stack):
    api, env, tmp = fleet
    name = f"rt-{uuid.uuid4().hex[:6]}"
    data = _spec(local_stack, name, "heavy_steps/gpu")
    try:
        out = _run(data, env, tmp / "home-a")
        assert out["ok"], out.get("error", "") + out["log"][-4000:]
        steps = out["manifest"]["steps"]
        for step in ("quantize", "build"):
            routed = steps[step]["routed"]
            assert routed["deployment"] == "heavy_steps/gpu" and routed["pool"] == "stoker-gpu"
            # Built in the container (host network: the host's name, the image's STOKER_HOME), downloaded here
            # from the shared cache.
            assert routed["layer"] == "built", routed
            assert routed["ran_on"] == f"{socket.gethostname()}:/var/lib/stoker", routed
            assert steps[step]["layer"] == "remote" and steps[step]["pulled_bytes"] > 0
        assert out["manifest"]["endpoint"] and out["manifest"]["status"] == "completed"

        # The routed run: a subflow of this run on the docker pool, completed; its container removed.
        run = api_get(api, f"/flow_runs/{steps['build']['routed']['flow_run']}")
        assert run["state"]["type"] == "COMPLETED" and run["parent_task_run_id"]
        assert run["work_pool_name"] == "stoker-gpu"
        client = docker_engine.connect()
        left = [c.name for c in client.containers.list(all=True, ignore_removed=True)
                if c.image.tags == ["stoker/worker:0.1.0"]]
        assert left == [], left
    finally:
        docker_engine.remove_deployment(docker_engine.connect(), name, lambda _m: None)


def test_a_pool_without_workers_or_a_missing_deployment_fails_at_preflight_naming_it(fleet, local_stack):
    api, env, tmp = fleet
    # build_and_deploy/stoker-cpu is registered on the process pool stoker-cpu, where no worker runs here.
    for heavy, says in (("build_and_deploy/stoker-cpu", "work pool 'stoker-cpu' of 'build_and_deploy/stoker-cpu' "
                                                        "has no online worker"),
                        ("heavy_steps/nowhere", "deployment 'heavy_steps/nowhere' is not registered")):
        out = _run(_spec(local_stack, f"rt-{uuid.uuid4().hex[:6]}", heavy), env, tmp / "home-c", timeout=120)
        assert not out["ok"] and says in out["error"], out
        assert out["s"] < 30, out["s"]  # fails fast: nothing waits for a worker
        assert "quantize:" not in out["log"] and "fetch: cache" not in out["log"]


def test_a_routed_run_no_worker_starts_is_cancelled_and_named(fleet):
    api, env, tmp = fleet
    code = r"""
import json
from stoker.orchestration.routing import Route, RoutingError, run_routed
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as c:
    dep = c.read_deployment_by_name("build_and_deploy/stoker-cpu")
route = Route("build_and_deploy/stoker-cpu", str(dep.id), "stoker-cpu", [])
try:
    run_routed(route, {"spec": {"model": {"repo_id": "a/b"}, "storage": {"bucket": "abc"}}}, "never-started", 3, 60,
               print)
except RoutingError as err:
    print("ERROR " + str(err))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("ERROR ")), None)
    assert line and "no worker of pool 'stoker-cpu' started" in line, (r.stdout + r.stderr)[-3000:]
    runs = api_get(api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": ["never-started"]}}})
    assert runs and runs[0]["state"]["type"] in ("CANCELLED", "CANCELLING"), runs
