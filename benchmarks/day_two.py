"""A scripted day two of one live deployment under load (issue 49 "Measure"); writes JSON.

    .venv/bin/python benchmarks/day_two.py [OUT.json]      (default benchmarks/results/day_two.json; ~8 min, 2 cores)

One deployment with API keys (a file of two keys; every load client sends the second), the promotion tests' tiny
scripted `ensemble` (tests/integration/serving_models.py), the load of benchmarks/operate.py (2 gRPC clients, a
long-lived and a busy bidi stream, 2 HTTP SSE clients, every request counted) through the stable address for the
whole day. The steps, each a phase whose requests are counted by their start time:

  deploy A; replace -> B; a run cancelled during its gates (C); switch to reload (D); reload in place (E);
  `stoker keys revoke` of the first key under load; replace with 2 replicas (F); one replica killed;
  `stoker rollback` twice; the rolled-back build re-triggered; the stack rebooted (dockerd and S3 stopped and
  started); deploys up to 20; `stoker prune --dry-run` then `stoker prune`.

Figures: requests lost (failed + truncated) per step (goal 0), seconds from `stoker keys revoke` to the first 401
for the revoked key (goal <= 5), what is on disk (STOKER_HOME) and in S3 after 2 deploys, after 20 and after prune.

What a step is, where it is not the product's whole path, is said in its own record (`how`). Real servers only:
moto S3, Docker, the CPU Triton image, the HAProxy proxy; the commands are the installed `stoker` CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_clients import KEY_ENV, request_values  # noqa: E402 -- after sys.path
from operate import attribute, start_load  # noqa: E402
from operate_run import Run  # noqa: E402

STOKER = str(Path(sys.executable).with_name("stoker"))
DEPLOYS_FOR_GROWTH = 20


def stoker(*args: str, timeout_s: float = 300) -> dict:
    """The installed CLI, as a user runs it: exit code, seconds, its last line."""
    t0 = time.monotonic()
    p = subprocess.run([STOKER, *args], capture_output=True, text=True, timeout=timeout_s, env=os.environ)
    out = (p.stdout + p.stderr).strip().splitlines()
    return {"command": "stoker " + " ".join(args), "rc": p.returncode, "seconds": round(time.monotonic() - t0, 2),
            "last_line": out[-1] if out else ""}


def status_with_key(endpoint: dict, key: str) -> int:
    model, values = request_values(1, text="x", http=True)
    req = urllib.request.Request(f"{endpoint['http']}/v2/models/{model}/generate_stream",
                                 data=json.dumps(values).encode(), headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


def state_size(run: Run) -> dict:
    """Files and bytes under STOKER_HOME, objects and bytes in the deployment's bucket."""
    home = Path(os.environ["STOKER_HOME"])
    files = [p for p in home.rglob("*") if p.is_file()]
    objs = [o for page in run.s3.get_paginator("list_objects_v2").paginate(Bucket=run.spec.storage.bucket)
            for o in page.get("Contents", [])]
    return {"local_files": len(files), "local_bytes": sum(p.stat().st_size for p in files),
            "s3_objects": len(objs), "s3_bytes": sum(o["Size"] for o in objs)}


def cancel_during_gates(run: Run, tag: str) -> dict:
    """A deploy in its own process stages C, then SIGTERM arrives while its gates run. Prefect delivers a cancel
    to a flow run's process as SIGTERM and raises TerminationSignal, a BaseException, in the flow
    (prefect/flow_engine.py); stoker's deploy step abandons the candidate on any BaseException
    (stoker/targets/base.py Target.deploy). The child does the same two things around stage and abandon."""
    uri, digest = run.build(tag)
    script = f"""
import json, signal, sys, time
sys.path.insert(0, {str(ROOT)!r})
from prefect.exceptions import TerminationSignal
from stoker.deploy import rollout
from stoker.spec.load import parse_spec
def on_term(signum, frame):
    raise TerminationSignal(signum)
signal.signal(signal.SIGTERM, on_term)
spec = parse_spec(json.loads({json.dumps(json.dumps(run.data))}), "operate")
staged = rollout.stage(spec, {uri!r}, {digest!r}, "cancelled", lambda l: print(l, flush=True))
print("GATES", flush=True)
try:
    time.sleep(120)
except BaseException as exc:
    print("ABANDON", rollout.abandon(spec, staged, lambda l: print(l, flush=True)), flush=True)
    raise
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=os.environ)
    abandoned = None
    for line in proc.stdout:
        if line.startswith("GATES"):
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
        elif line.startswith("ABANDON"):
            abandoned = line.split(" ", 1)[1].strip()
    proc.wait(timeout=60)
    from operate_faults import rollout_backends

    return {"exit_code": proc.returncode, "abandoned": abandoned, "backends_after": rollout_backends(run),
            "how": "stage and abandon of stoker.deploy.rollout in a child process, SIGTERM raising Prefect's "
                   "TerminationSignal during the gates (not a whole flow run)"}


def day(run: Run, tag: str, rollout: str = "replace", **deploy) -> dict:
    """Run.deploy (what `stoker run` does after its upload), ``deploy`` overrides kept for the rest of the day. Its
    manifest also gets what a pipeline run's holds and the rollback check reads: the spec digest and the model
    commit, here the build's digest (the scripted builds have no Hub commit)."""
    run.data["deploy"].update(deploy)
    done = run.deploy(tag, rollout)
    path = Path(os.environ["STOKER_HOME"]) / "runs" / f"20261123T{run.runs:06d}-{tag.lower()}" / "manifest.json"
    m = json.loads(path.read_text())
    m.update(spec_digest=run.spec_for(rollout).digest(),
             model={"sha": m["steps"]["upload"]["digest"], "repo_id": None, "revision": None})
    from stoker.atomic import write_atomic

    write_atomic(path, json.dumps(m))
    return done


def kill_replica(run: Run) -> dict:
    from stoker.containers import engine

    client = engine.connect()
    members = sorted((c for c in engine.containers(client, run.spec.deploy.name, role=engine.ROLE_BACKEND)
                      if c.status == "running"), key=lambda c: c.name)
    if len(members) < 2:
        raise RuntimeError(f"{len(members)} backend(s) running: nothing to kill beside the live one")
    victim = members[-1]
    # Its process dies (a crash, an OOM kill): Docker's restart policy brings it back. (`docker kill` through the API
    # would count as stopping it by hand, which the restart policy leaves stopped.)
    os.kill(victim.attrs["State"]["Pid"], signal.SIGKILL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 90:
        victim.reload()
        if victim.status == "running" and victim.attrs["RestartCount"] > 0:
            break
        time.sleep(0.2)
    time.sleep(5.0)  # the health check brings it back into rotation; clients keep running meanwhile
    victim.reload()
    return {"killed": victim.name, "running_again_after_s": round(time.monotonic() - t0 - 5.0, 2),
            "restart_count": victim.attrs["RestartCount"]}


def rollback(run: Run) -> dict:
    from stoker.commands.rollback import rollback_to

    return rollback_to(run.spec.deploy.name, None, run.log)


def retrigger(run: Run) -> dict:
    """The preflight's check (tasks/preflight.refuse_rolled_back) over this host's records: the spec at the commit
    of the rolled-back build must be refused without force."""
    from stoker.record import rollbacks
    from stoker.record.manifest import read_manifests

    every = read_manifests(Path(os.environ["STOKER_HOME"]))
    rolled = [m for m in every if rollbacks.is_rollback(m)]
    if not rolled:
        raise RuntimeError("no rollback record on this host")
    src = rolled[-1]["from"]
    line = rollbacks.refusal(every, src.get("spec_digest"), src.get("sha"))
    forced = rollbacks.refusal(every, src.get("spec_digest"), src.get("sha"), force=True)
    return {"refused": line, "with_force": forced, "how": "the refusal preflight runs, on the day's records"}


def reboot(run: Run, s3_port: int) -> dict:
    """dockerd and the S3 server stopped, then started again as after a reboot; the endpoint comes back?"""
    from stoker.stack.s3server import ensure_s3
    from stoker.stack.services import stop_all

    pid = int(subprocess.run(["pidof", "dockerd"], capture_output=True, text=True).stdout.split()[0])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    down_at = time.monotonic()
    stop_all(run.state)
    ensure_s3(run.state, port=s3_port, data_dir=run.state / "s3-data")  # the stack's S3 keeps its data on disk
    subprocess.run(["bash", str(ROOT / "infra" / "dockerd.sh")], check=True, capture_output=True)
    tag = None
    while time.monotonic() - down_at < 180:
        tag, _ = run.serving()
        if tag and not tag.startswith("no answer"):
            break
        time.sleep(0.5)
    back = round(time.monotonic() - down_at, 2)
    if not tag or tag.startswith("no answer"):
        raise RuntimeError(f"the endpoint did not answer within 180 s of the reboot ({tag})")
    return {"back_after_s": back, "serving": tag}


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "benchmarks" / "results" / "day_two.json").resolve()
    os.environ[KEY_ENV] = f"daytwo-{uuid.uuid4().hex}"
    from stoker.spec.schema import Deploy
    from stoker.stack.image import ensure_proxy_image
    from stoker.stack.services import stop_all

    ensure_proxy_image(Deploy().proxy_image, None, lambda _l: None, base=Deploy().image)
    state = Path(tempfile.mkdtemp(prefix="stoker-daytwo-"))
    from stoker.stack.s3server import ensure_s3

    ensure_s3(state, data_dir=state / "s3-data")  # as `make stack` and the demo start it; Run reuses it
    run = Run(state)
    s3_port = int(run.data["storage"]["endpoint_url"].rsplit(":", 1)[1])
    spec_file = state / "day2.json"  # JSON is YAML: what a user's spec file would hold
    spec_file.write_text(json.dumps(run.spec_for().model_dump(mode="json", exclude_none=True)))
    old_key = Path(run.data["deploy"]["api_keys"]["file"]).read_text().splitlines()[0]
    t_start = time.time()
    sizes: dict = {}
    revoke: dict = {}
    from stoker.containers import engine

    stop = None
    try:
        first = run.phase("deploy A (first backend)", lambda: day(run, "A"))
        endpoint = first["endpoint_after"]
        stop, loader, load_out = start_load(state, endpoint)
        run.phase("replace -> B", lambda: day(run, "B"))
        sizes["after_2_deploys"] = state_size(run)
        run.phase("run cancelled during its gates (C)", lambda: cancel_during_gates(run, "C"))
        run.phase("switch to reload (D)", lambda: day(run, "D", "reload"))
        run.phase("reload in place (E)", lambda: day(run, "E", "reload"))

        def revoke_step() -> dict:
            before = status_with_key(endpoint, old_key)
            t0 = time.monotonic()
            res = stoker("keys", str(spec_file), "revoke", hashlib.sha256(old_key.encode()).hexdigest()[:12])
            while status_with_key(endpoint, old_key) != 401 and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            took = round(time.monotonic() - t0, 2)
            revoke.update(seconds_to_401=took, status_before=before, status_after=status_with_key(endpoint, old_key),
                          goal_s=5, met=res["rc"] == 0 and took <= 5 and before == 200)
            return {**res, **revoke}

        run.phase("stoker keys revoke (the first key) under load", revoke_step)
        run.phase("replace with 2 replicas -> F", lambda: day(run, "F", replicas=2))
        run.phase("one replica killed", lambda: kill_replica(run))
        run.phase("stoker rollback (1)", lambda: rollback(run))
        run.phase("stoker rollback (2)", lambda: rollback(run))
        run.phase("the rolled-back build re-triggered", lambda: retrigger(run))
        run.phase("the stack rebooted (dockerd and S3 stopped, started)", lambda: reboot(run, s3_port))
        n = run.runs
        for i in range(n, DEPLOYS_FOR_GROWTH):
            if run.phase(f"replace -> G{i}", lambda i=i: day(run, f"G{i}"))["outcome"] != "ok":
                break  # recorded; the day goes on to what remains
        sizes["after_20_deploys"] = {**state_size(run), "deploys": run.runs, "growth_deploys_from": n}
        run.phase("stoker prune --dry-run", lambda: stoker("prune", "--dry-run", "--spec", str(spec_file)))
        run.phase("stoker prune", lambda: stoker("prune", "--spec", str(spec_file)))
        sizes["after_prune"] = state_size(run)
        time.sleep(3)
        stop.set()
        loader.join(120)
        records = json.loads(load_out.read_text())["records"]
    finally:
        if stop is not None:
            stop.set()
        engine.remove_deployment(engine.connect(), run.spec.deploy.name, lambda _l: None)
        stop_all(state)

    attribute(records, run.phases)
    steps = [{"step": p["phase"], "requests": p["requests"], "lost": p["failed"] + p["truncated"],
              "failed": p["failed"], "truncated": p["truncated"], "outcome": p["outcome"],
              "cause": p.get("cause"), "serving_after": p["serving_after"], "errors": p["errors"],
              "seconds": round(p["end"] - p["start"], 2), "from_s": round(p["start"] - t_start, 2),
              "result": p.get("result")} for p in run.phases]
    lost = sum(s["lost"] for s in steps)
    data = {
        "goals": {"requests_lost_per_step": 0, "seconds_revoke_to_401": 5},
        "requests": len(records), "lost": lost,
        "steps_with_losses": [s["step"] for s in steps if s["lost"]],
        "revoke": revoke, "state": sizes, "steps": steps,
        "meta": {"machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "wall_s": round(time.time() - t_start, 1),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "load": "benchmarks/operate.py's: 2 gRPC stream clients, a long-lived and a busy bidi stream, "
                         "2 HTTP SSE clients, all with the second API key",
                 "model": "the promotion tests' scripted ensemble (tests/integration/serving_models.py): not a "
                          "built model; the serving path (proxy, backends, S3, commands) is real"},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    print(json.dumps({k: data[k] for k in ("requests", "lost", "steps_with_losses", "revoke", "state")}, indent=1,
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
