"""The watcher's schedule fires, on both servers stoker runs: PostgreSQL (`make stack`) and SQLite (the demo's).

Watched as it fires, not as declared: the watcher is deployed with a 15 s interval on a pool with a process
worker, before its repo exists in the Hub mirror. Then a commit is pushed; the *scheduler* — no manual run is
made — starts build_and_deploy pinned to the new sha; the next ticks start nothing.
(With SQLAlchemy 2.1, Prefect 3.8.8's scheduler failed every loop and this started nothing: issue 22.)
On both servers the build's pool holds it (an online worker, concurrency limit 0): what differs by database is the
scheduler's, not the build. A build that a watcher started on `make stack`'s PostgreSQL server running on its worker,
completing and serving is test_operate_walkthrough's (docs/triggers.md's watcher tick, then `stoker status
tiny-watched` ready); a full build here too cost CI about 2.5 minutes for nothing new. benchmarks/triggers.py
(STOKER_OPERATE_OUT set) still lets the PostgreSQL one build and serve, to time commit → serving.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from operate_helpers import (
    ROOT,
    api_get,
    deployment_id,
    flow_runs,
    make_spec,
    prefect_env,
    record,
    set_pool_limit,
    stoker,
    wait_final,
    wait_online,
)

pytestmark = [pytest.mark.prefect, pytest.mark.hub, pytest.mark.s3, pytest.mark.docker, pytest.mark.slow]

INTERVAL_S = 15


@pytest.fixture(params=["sqlite", "postgres"])
def server(request, tmp_path_factory):
    from stoker.stack.prefect_stack import PG_BIN, ensure_postgres, ensure_server
    from stoker.stack.services import stop_all

    state = tmp_path_factory.mktemp(f"sched-{request.param}")
    if request.param == "postgres":
        assert (PG_BIN / "initdb").exists() and shutil.which("runuser"), "infra/test-deps.sh installs PostgreSQL 15"
        api = ensure_server(state, database_url=ensure_postgres(state))
    else:
        api = ensure_server(state)
    yield request.param, api, state
    stop_all(state)


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _deploy(tmp_path, api, pool: str, build_pool: str, spec: dict) -> None:
    """build_and_deploy on `build_pool` and a watcher every INTERVAL_S on `pool`, through `stoker deploy-flows`."""
    repo = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    watch = next(d for d in repo["deployments"] if d["name"] == "watch")
    deployments = [
        {"name": pool, "entrypoint": "flows/build_and_deploy.py:build_and_deploy", "work_pool": {"name": build_pool}},
        {**watch, "name": f"{pool}-watch", "work_pool": {"name": pool}, "schedules": [{"interval": INTERVAL_S}],
         "parameters": {"watches": [{"spec": spec, "deployment": f"build_and_deploy/{pool}"}]}},
    ]
    pools = [{"name": p} for p in dict.fromkeys((pool, build_pool))]
    (tmp_path / "platform.yaml").write_text(yaml.safe_dump({"work_pools": pools}))
    (tmp_path / "prefect.yaml").write_text(yaml.safe_dump({"build": repo["build"], "pull": repo["pull"],
                                                           "deployments": deployments}))
    (tmp_path / "specs").mkdir()
    r = stoker(["deploy-flows", "--platform", str(tmp_path / "platform.yaml"), "--prefect-file",
                str(tmp_path / "prefect.yaml"), "--specs", str(tmp_path / "specs")], env=prefect_env(api), timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def _watch_runs(api, dep: str) -> list[dict]:
    return flow_runs(api, dep)


def test_the_schedule_starts_one_build_per_new_commit(server, local_stack, triton_image, tmp_path,
                                                      tmp_path_factory):
    from stoker.stack.hub_mirror import publish_model
    from stoker.stack.prefect_stack import ensure_worker

    db, api, state = server
    pool = f"sched-{uuid.uuid4().hex[:6]}"
    builds_here = db == "postgres" and bool(os.environ.get("STOKER_OPERATE_OUT"))  # the benchmark's timing only
    build_pool = pool if builds_here else f"{pool}-held"
    home = tmp_path_factory.mktemp("wh")  # short: the proxy's admin socket path must fit AF_UNIX's 108 bytes
    ensure_worker(state, api, pool, cwd=ROOT, env={**local_stack["aws_env"], "STOKER_HOME": str(home / "stoker"),
                                                   "HF_HOME": str(home / "hf")})
    if not builds_here:
        # The watcher starts a build only on a pool with an online worker; this one takes nothing (its limit below).
        ensure_worker(state, api, build_pool, cwd=ROOT, name=f"prefect-worker-{build_pool}")
    repo_id = f"stoker/sched-{uuid.uuid4().hex[:6]}"
    name = f"sched-{db[:2]}-{uuid.uuid4().hex[:4]}"
    spec = make_spec(local_stack, name)
    spec["model"]["repo_id"] = repo_id
    spec["evaluation"] = {"enabled": False}  # the gates are test_promotion's; this test is about the trigger
    _deploy(tmp_path, api, pool, build_pool, spec)
    if not builds_here:
        wait_online(api, build_pool)
        set_pool_limit(api, build_pool, 0)  # before the commit: no build exists yet that the worker could take
    watch_dep = deployment_id(api, "watch_revisions", f"{pool}-watch")
    build_dep = deployment_id(api, "build_and_deploy", pool)

    try:
        # Ticks fire before the repo exists: each fails in one line, none starts a build.
        deadline = time.monotonic() + 180
        while not [r for r in _watch_runs(api, watch_dep) if r["state"]["type"] in ("FAILED", "COMPLETED")]:
            assert time.monotonic() < deadline, "the scheduler started no watcher run in 180 s"
            time.sleep(2)
        assert flow_runs(api, build_dep) == []

        # A commit: the tiny Llama as the repo's first revision.
        src = local_stack["repos"] / "models" / local_stack["repo_id"]
        t_commit = time.time()
        sha = publish_model(local_stack["repos"], repo_id, _export(src, tmp_path / "export"), "weights")
        deadline = time.monotonic() + 180
        while not (builds := flow_runs(api, build_dep)):
            assert time.monotonic() < deadline, "no build started in 180 s after the commit"
            time.sleep(1)
        if builds_here:
            build = wait_final(api, builds[0]["id"], timeout_s=900)
            assert build["state"]["type"] == "COMPLETED", build["state"]
            http = spec["deploy"]["ports"]["http"]
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=10) as resp:
                assert resp.status == 200
            t_done = _ts(build["end_time"])
        else:
            build = builds[0]
            assert build["state"]["type"] == "SCHEDULED", build["state"]  # held by its pool's limit
            t_done = _ts(build["created"])
        assert build["parameters"]["spec"]["model"]["revision"] == sha
        assert build["idempotency_key"] == f"stoker-watch:build_and_deploy/{pool}:{name}:{sha}"

        # The next ticks see the same sha and start nothing.
        deadline = time.monotonic() + 300
        while True:
            later = [r for r in _watch_runs(api, watch_dep) if r["state"]["type"] == "COMPLETED"
                     and _ts(r["start_time"]) > t_done]
            if len(later) >= 2:
                break
            assert time.monotonic() < deadline, "fewer than 2 ticks completed in 300 s after the build started"
            time.sleep(2)
        assert [b["id"] for b in flow_runs(api, build_dep)] == [build["id"]]
        # Every watcher run was the scheduler's: none was made by hand.
        runs = _watch_runs(api, watch_dep)
        assert runs and all(r["auto_scheduled"] for r in runs)
        what = "serving" if builds_here else "build started"
        record(f"schedule_{db}", {f"commit_to_{what.replace(' ', '_')}_s": round(t_done - t_commit, 1),
                                  "interval_s": INTERVAL_S, "ticks_after": len(later), "builds": 1})
        print(f"{db}: commit → {what} {t_done - t_commit:.1f} s (interval {INTERVAL_S} s); "
              f"{len(later)} later ticks started nothing")
    finally:
        from stoker.containers.engine import connect, remove_deployment

        api_get(api, f"/deployments/{watch_dep}/schedules")  # the server still answers (a crash shows here)
        subprocess.run([str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deployment", "delete",
                        f"watch_revisions/{pool}-watch"], cwd=ROOT, env=prefect_env(api), capture_output=True,
                       timeout=120)
        remove_deployment(connect(), name, lambda _m: None)


def _export(repo_dir, dest):
    """The mirror's tiny Llama files (no .git), to publish as another repo's commit."""
    shutil.copytree(repo_dir, dest, ignore=shutil.ignore_patterns(".git"))
    return dest
