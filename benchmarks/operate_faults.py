"""The faults benchmarks/operate.py injects during its load, each a phase: a deploy SIGKILLed midway then rerun,
the proxy killed, an internal port taken, dockerd restarted mid-deploy. Each returns the phase's result (JSON).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from operate_run import Run

ROOT = Path(__file__).resolve().parents[1]


def kill_deploy_midway(run: Run, tag: str) -> dict:
    """A deploy in its own process, SIGKILLed while its candidate settles; then a rerun of another build."""
    uri, digest = run.build(tag)
    script = f"""
import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
from stoker.deploy import rollout
from stoker.spec.load import parse_spec
spec = parse_spec(json.loads({json.dumps(json.dumps({**run.data, 'deploy': {**run.data['deploy'], 'settle_s': 60}}))}),
                  "operate")
rollout.stage(spec, {uri!r}, {digest!r}, "killed", lambda l: print(l, flush=True), standin={run.standin!r})
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ)
    for line in proc.stdout:
        if "proven" in line or "ready after" in line or "staging" in line:
            time.sleep(4.0)
            proc.kill()
            break
    proc.wait(timeout=30)
    left = rollout_backends(run)
    rerun = run.deploy(f"{tag}2")
    return {"backends_after_kill": left, "rerun": rerun["live"]["container"]}


def rollout_backends(run: Run) -> int:
    from stoker.containers import engine

    return len(engine.containers(engine.connect(), run.spec.deploy.name, role=engine.ROLE_BACKEND))


def kill_proxy(run: Run) -> dict:
    from stoker.containers import engine
    from stoker.serving import promote

    c = promote.proxy_container(engine.connect(), run.spec.deploy.name)
    os.kill(c.attrs["State"]["Pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        tag, _ = run.serving()
        if tag and not tag.startswith("no answer"):
            break
        if time.monotonic() - t0 > 60:
            raise RuntimeError("proxy did not come back within 60 s")
        time.sleep(0.1)
    back = time.monotonic() - t0
    time.sleep(2.0)  # the phase keeps the kill's tail: clients still reconnecting after the first answer
    c.reload()
    return {"back_after_s": round(back, 2), "restart_count": c.attrs["RestartCount"]}


def take_internal_port(run: Run, tag: str) -> dict:
    from stoker.containers import engine
    from stoker.serving import promote
    from stoker.containers.ports import choose_backend_ports, is_port_free

    client = engine.connect()
    claimed = {p for b in promote.observe_backends(client, run.spec.deploy.name) for p in b.ports.values()}
    first = choose_backend_ports(is_port_free, claimed, seed=f"{run.spec.deploy.name}/1",
                                 avoid=set(run.spec.deploy.ports.model_dump().values()))
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", first.grpc))
        squatter.listen()
        done = run.deploy(tag)
    return {"taken": first.grpc, "candidate_ports": done["live"]["ports"]}


def restart_dockerd_mid_deploy(run: Run, tag: str) -> dict:
    """Stop dockerd (SIGTERM) while a candidate settles, start it again; Docker's restart policy does the rest."""
    pid = int(subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()[0])
    uri, digest = run.build(tag)
    from stoker.deploy import rollout as ro

    spec = run.spec_for("replace", settle_s=30)
    err: list = []

    def deploy() -> None:
        try:
            ro.stage(spec, uri, digest, "dockerd", run.log, standin=run.standin)
        except Exception as exc:  # noqa: BLE001 - the expected one-line cause
            err.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

    t = threading.Thread(target=deploy)
    t.start()
    time.sleep(8.0)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    down_at = time.monotonic()
    subprocess.run(["bash", str(ROOT / "infra" / "dockerd.sh")], check=True, capture_output=True)
    t.join(timeout=120)
    while True:
        tag_now, _ = run.serving()
        if tag_now and not tag_now.startswith("no answer"):
            break
        if time.monotonic() - down_at > 120:
            break
        time.sleep(0.2)
    after = run.deploy(f"{tag}2")  # the next deploy reconciles what the restart left
    if err:
        raise RuntimeError(f"deploy during the restart failed: {err[0]}; endpoint back after "
                           f"{time.monotonic() - down_at:.1f} s; next deploy served {after['live']['container']}")
    return {"note": "deploy survived the restart", "next": after["live"]["container"]}
