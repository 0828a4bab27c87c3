"""The fleet measurement (issue 13): one 4-format matrix three ways, on real servers, results in JSON.

  a  1 process worker, cold local cache, cold S3 cache (a fresh prefix)
  b  2 process workers, each with its own STOKER_HOME, cold local caches, cold S3 cache (another fresh prefix)
  c  2 process workers with fresh (cold) STOKER_HOMEs, the S3 cache b left (warm)

Everything runs on 127.0.0.1 and is started here: PostgreSQL 15 + `prefect server start` (basic auth), moto S3,
the olah Hub mirror with the tiny Llama, Docker with the Triton CPU image. The workers share only the Prefect API
and S3. build_matrix runs in a process of its own with `deployment=build_and_deploy/fleet`, so every entry is a
flow run that one of the workers picks up. Counted from the entries' run manifests in the workers' homes:

- heavy steps (fetch, quantize, build, package) executed per worker: step entries with layer "built";
- duplicates: (step, key) pairs built more than once in one mode (must be 0);
- bytes pulled from the shared cache: the steps' pulled_bytes;
- orchestration overhead per entry run: manifest wall_s minus the time its steps covered (the union of their
  intervals: the baseline runs while the candidate starts, so a plain sum of step times would count that twice),
  as a share of wall_s; the plain sum is reported beside it;
- what Prefect itself costs: beside each mode's matrix, on the same server, a flow of 16 no-op tasks made as stoker
  makes its steps runs every few seconds; its (wall - time inside the tasks) / 16 is Prefect's cost per task under
  that load, and each entry's overhead is set beside its number of tasks times that cost (`prefect_floor_s`, and
  `beyond_prefect_share`: what is left for stoker to remove).

Usage: .venv/bin/python benchmarks/fleet.py [--formats none,fp8,int8_sq,int4_awq] [--modes a,b,c]
       [--out benchmarks/results/fleet.json] [--no-evaluation]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEAVY = ("fetch", "quantize", "build", "package")
POOL, DEPLOYMENT = "fleet-cpu", "fleet"
# Each worker runs at most this many flow runs at once (`prefect worker start --limit`): its capacity. Without it
# the first worker to poll takes every scheduled entry, and a second worker adds nothing.
WORKER_LIMIT = 2
MODES = {"a": ("1 worker, cold local and S3 caches", 1, "cold"),
         "b": ("2 workers, cold local and S3 caches", 2, "cold"),
         "c": ("2 workers, cold local caches, warm S3 cache (b's)", 2, "warm")}
MATRIX = """
import json, sys, time
from flows.build_matrix import build_matrix
from stoker.spec.load import parse_spec
spec, formats = parse_spec(json.loads(sys.argv[1]), "fleet"), json.loads(sys.argv[2])
t0 = time.monotonic()
out = build_matrix(spec, formats, promote=False, max_parallel=len(formats), deployment=sys.argv[3])
print("RESULT " + json.dumps({"wall_s": time.monotonic() - t0, "rows": out["rows"]}))
"""
REGISTER = """
from flows.build_and_deploy import build_and_deploy
from prefect.deployments.runner import EntrypointType
from stoker.commands.deploy_flows import ensure_work_pool
from prefect.client.orchestration import get_client
import sys
with get_client(sync_client=True) as c:
    ensure_work_pool(c, sys.argv[1], "process")
print(build_and_deploy.to_deployment(name=sys.argv[2], work_pool_name=sys.argv[1],
                                     entrypoint_type=EntrypointType.MODULE_PATH).apply())
"""


# What Prefect itself costs per task on this server under this load: a flow of no-op tasks made as stoker makes its
# steps (tasks.step_task: no result cache, no persistence, one log line each), run again and again beside a mode's
# matrix; per run, (the flow's wall - the time inside the task bodies) / tasks. Timed inside the flow function, as
# stoker times wall_s, so the flow run's start and end are outside both figures.
PROBE = """
import json, sys, time
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

@task(name="probe", retries=3, cache_policy=NO_CACHE, persist_result=False)
def step(i):
    t0 = time.perf_counter()
    get_run_logger().info(f"probe step {i}")
    return time.perf_counter() - t0

@flow(name="prefect-probe")
def probe(n):
    t0 = time.perf_counter()
    inside = sum(step(i) for i in range(n))
    return (time.perf_counter() - t0 - inside) / n

stop, n = sys.argv[1], int(sys.argv[2])
import os
while not os.path.exists(stop):
    print(json.dumps({"per_task_s": probe(n)}), flush=True)
    time.sleep(3)  # a light duty cycle: the probe measures the load, it should add little to it
"""
PROBE_TASKS = 16  # about as many as an entry run's steps


def start_probe(state: Path, stack: dict, mode: str) -> tuple[subprocess.Popen, Path]:
    stop = state / f"probe-{mode}.stop"
    proc = subprocess.Popen([sys.executable, "-c", PROBE, str(stop), str(PROBE_TASKS)], cwd=ROOT, env=stack["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return proc, stop


def stop_probe(proc: subprocess.Popen, stop: Path) -> dict:
    stop.touch()
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    costs = sorted(json.loads(line)["per_task_s"] for line in out.splitlines() if line.startswith("{"))
    if not costs:
        return {"runs": 0}
    return {"runs": len(costs), "tasks_per_run": PROBE_TASKS, "per_task_s_median": round(costs[len(costs) // 2], 4),
            "per_task_s_min": round(costs[0], 4), "per_task_s_max": round(costs[-1], 4)}


def with_prefect_floor(overhead: dict, per_task_s: float | None) -> dict:
    """Each entry's overhead beside what Prefect costs for its number of tasks (the probe's median per task)."""
    if not per_task_s:
        return overhead
    for o in overhead["per_entry"]:
        floor = o["tasks"] * per_task_s
        o.update(prefect_floor_s=round(floor, 3), prefect_floor_share=round(floor / o["wall_s"], 4),
                 beyond_prefect_share=round(max(0.0, o["overhead_s"] - floor) / o["wall_s"], 4))
    beyond = [o["beyond_prefect_share"] for o in overhead["per_entry"]]
    overhead["beyond_prefect_max_share"] = max(beyond) if beyond else None
    return overhead


def say(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def start_stack(state: Path) -> dict:
    from stoker.demo import DEMO_REPO, ensure_tiny_model
    from stoker.stack.hub_mirror import ensure_mirror, repos_dir
    from stoker.stack.prefect_stack import ensure_postgres, ensure_server
    from stoker.stack.s3server import ensure_s3, s3_env

    say("PostgreSQL 15 + prefect server start")
    api = ensure_server(state, database_url=ensure_postgres(state))
    say("moto S3, olah Hub mirror, tiny Llama")
    ensure_tiny_model(repos_dir(state), log=lambda _l: None)
    hub, s3 = ensure_mirror(state), ensure_s3(state)
    aws = {k: v for k, v in s3_env(s3).items() if k != "AWS_ENDPOINT_URL"}
    # One place for persisted flow results, so the matrix process reads each entry's manifest (its run result).
    results = state / "prefect-results"
    results.mkdir()
    env = {**os.environ, **api.env(), **aws, "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
           "PREFECT_LOCAL_STORAGE_PATH": str(results)}
    return {"api": api, "hub": hub, "s3": s3, "repo": DEMO_REPO, "env": env}


def spec_for(stack: dict, prefix: str, evaluation: bool) -> dict:
    from stoker.demo import DEMO_SPEC

    data = yaml.safe_load(DEMO_SPEC.read_text())
    data["model"]["endpoint"] = stack["hub"]
    data["quantization"]["calibration"] = {"samples": 4, "seq_len": 32, "batch_size": 4}
    data["storage"].update(bucket="stoker-fleet", prefix=prefix, endpoint_url=stack["s3"], create_bucket=True,
                           shared_cache=True)
    data["deploy"] = {"name": DEPLOYMENT, "settle_s": 1, "watch_s": 2}
    data["benchmark"].update({"concurrency": [1], "requests_per_level": 4, "output_tokens": 16, "warmup_requests": 1})
    data["evaluation"] = ({"max_windows": 2, "prompts": 2, "window_tokens": 32, "prompt_tokens": 8,
                           "greedy_tokens": 8} if evaluation else {"enabled": False})
    return data


def start_workers(state: Path, stack: dict, n: int, mode: str) -> list[tuple[str, Path]]:
    from stoker.stack.prefect_stack import ensure_worker

    workers = []
    for i in range(n):
        name, home = f"fleet-{mode}-w{i + 1}", state / f"home-{mode}-w{i + 1}"
        env = {k: v for k, v in stack["env"].items() if not k.startswith("PREFECT_API")}
        env |= {"STOKER_HOME": str(home), "HF_HOME": str(state / f"hf-{mode}-{i}")}
        ensure_worker(state, stack["api"], POOL, cwd=ROOT, env=env, name=name, limit=WORKER_LIMIT)
        workers.append((name, home))
    wait_online(len(workers), [w for w, _ in workers])
    return workers


def wait_online(n: int, names: list[str], timeout_s: float = 120) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            online = {w.name for w in client.read_workers_for_work_pool(POOL) if w.status == WorkerStatus.ONLINE}
            if set(names) <= online:
                return
            time.sleep(1)
    raise RuntimeError(f"workers {names} not all online on {POOL} within {timeout_s:.0f} s")


def run_matrix(stack: dict, data: dict, formats: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", MATRIX, json.dumps(data), json.dumps(formats),
                        f"build_and_deploy/{DEPLOYMENT}"], cwd=ROOT, env=stack["env"], capture_output=True,
                       text=True, timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"matrix failed (exit {r.returncode}): {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def tally(workers: list[tuple[str, Path]]) -> dict:
    """The mode's counts, from the manifests the workers' runs wrote."""
    manifests = [(name, json.loads(p.read_text())) for name, home in workers
                 for p in sorted((home / "runs").glob("*/manifest.json"))]
    built = Counter()
    per_worker = defaultdict(lambda: {"entry_runs": 0, "heavy_executed": 0, "heavy_cache_hits": 0,
                                      "pulled_bytes": 0, "executed": []})
    overheads = []
    for name, m in manifests:
        w = per_worker[name]
        w["entry_runs"] += 1
        for step, st in m["steps"].items():
            w["pulled_bytes"] += st.get("pulled_bytes", 0)
            if step not in HEAVY:
                continue
            if st.get("layer") == "built":
                built[(step, st["key"])] += 1
                w["heavy_executed"] += 1
                w["executed"].append(f"{step} ({m['spec']['quantization']['format']})")
            else:
                w["heavy_cache_hits"] += 1
        overheads.append({"entry": m["spec"]["deploy"]["name"], "worker": name, "status": m["status"],
                          "wall_s": m["wall_s"], "steps_covered_s": round(m["wall_s"] - m["overhead_s"], 3),
                          "steps_sum_s": round(sum(st["duration_s"] for st in m["steps"].values()), 3),
                          "overhead_s": m["overhead_s"], "overhead_share": round(m["overhead_s"] / m["wall_s"], 4),
                          "tasks": len(m["steps"])})
    shares = [o["overhead_share"] for o in overheads]
    return {"entry_runs": len(manifests), "per_worker": dict(per_worker),
            "heavy_executed": sum(built.values()), "distinct_heavy_keys_built": len(built),
            "duplicate_heavy_executions": sum(c - 1 for c in built.values() if c > 1),
            "pulled_bytes": sum(w["pulled_bytes"] for w in per_worker.values()),
            "overhead": {"per_entry": overheads, "mean_share": round(sum(shares) / len(shares), 4) if shares else None,
                         "max_share": max(shares) if shares else None}}


def summarize(done: dict) -> dict:
    """The figures the issue asks for, across modes. Overhead is judged per mode on the mean over its entry runs;
    a failed entry's cleanup (its candidate stopped outside any step) counts as overhead, so the mean over the
    completed entries is given beside it."""
    def mean(xs):
        return round(sum(xs) / len(xs), 4) if xs else None

    completed = {k: mean([o["overhead_share"] for o in m["overhead"]["per_entry"] if o["status"] == "completed"])
                 for k, m in done.items()}
    return {
        "duplicate_heavy_executions": sum(m["duplicate_heavy_executions"] for m in done.values()),
        "overhead_goal_share": 0.05,
        "overhead_mean_share_by_mode": {k: m["overhead"]["mean_share"] for k, m in done.items()},
        "overhead_mean_share_completed_entries_by_mode": completed,
        "overhead_goal_met_mean": all((m["overhead"]["mean_share"] or 0) <= 0.05 for m in done.values()),
        "overhead_goal_met_completed_entries": all((v or 0) <= 0.05 for v in completed.values()),
        "overhead_max_share_per_entry_by_mode": {k: m["overhead"]["max_share"] for k, m in done.items()},
        "overhead_goal_met_every_entry": all((m["overhead"]["max_share"] or 0) <= 0.05 for m in done.values()),
        # What is left of each entry's overhead once Prefect's own per-task cost, measured beside the matrix, is out
        "overhead_beyond_prefect_max_share_by_mode": {k: m["overhead"].get("beyond_prefect_max_share")
                                                      for k, m in done.items()},
        "prefect_per_task_s_by_mode": {k: m.get("prefect_probe", {}).get("per_task_s_median") for k, m in done.items()},
        "warm_s3_all_hits": done["c"]["heavy_executed"] == 0 if "c" in done else None,
        "wall_ratio_b_over_a": (round(done["b"]["matrix_wall_s"] / done["a"]["matrix_wall_s"], 3)
                                if {"a", "b"} <= done.keys() else None),
        "wall_ratio_c_over_b": (round(done["c"]["matrix_wall_s"] / done["b"]["matrix_wall_s"], 3)
                                if {"b", "c"} <= done.keys() else None),
    }


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the servers this started
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="none,fp8,int8_sq,int4_awq")
    ap.add_argument("--modes", default="a,b,c")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet.json"))
    ap.add_argument("--no-evaluation", action="store_true")
    ap.add_argument("--resummarize", action="store_true", help="recompute --out's summary from its modes; no run")
    args = ap.parse_args()
    if args.resummarize:
        out = json.loads(Path(args.out).read_text())
        out["summary"] = summarize(out["modes"])
        write_json(Path(args.out), out)
        return 0
    formats, modes = args.formats.split(","), args.modes.split(",")
    from stoker.stack.services import stop_all, stop_service

    state = Path(tempfile.mkdtemp(prefix="stoker-fleet-"))
    out = {"benchmark": "fleet", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
           "formats": formats, "evaluation": not args.no_evaluation, "max_parallel": len(formats),
           "worker_limit": WORKER_LIMIT,
           "heavy_steps": list(HEAVY), "modes": {}}
    try:
        stack = start_stack(state)
        os.environ.update({k: v for k, v in stack["env"].items() if k.startswith("PREFECT_")})
        r = subprocess.run([sys.executable, "-c", REGISTER, POOL, DEPLOYMENT], cwd=ROOT, env=stack["env"],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"registering build_and_deploy/{DEPLOYMENT}: {r.stderr[-2000:]}")
        prefixes = {"a": f"fleet-a-{uuid.uuid4().hex[:6]}", "b": f"fleet-b-{uuid.uuid4().hex[:6]}"}
        prefixes["c"] = prefixes["b"]
        for mode in modes:
            what, n, s3_cache = MODES[mode]
            say(f"mode {mode}: {what}")
            workers = start_workers(state, stack, n, mode)
            probe = start_probe(state, stack, mode)
            try:
                result = run_matrix(stack, spec_for(stack, prefixes[mode], not args.no_evaluation), formats)
            finally:
                prefect_cost = stop_probe(*probe)
                for name, _home in workers:
                    stop_service(name, state)
            counts = tally(workers)
            counts["prefect_probe"] = prefect_cost
            counts["overhead"] = with_prefect_floor(counts["overhead"], prefect_cost.get("per_task_s_median"))
            out["modes"][mode] = {"what": what, "workers": n, "s3_cache": s3_cache, "prefix": prefixes[mode],
                                  "matrix_wall_s": round(result["wall_s"], 2),
                                  "entries": [{k: row.get(k) for k in ("format", "status", "cause",
                                                                       "output_tokens_per_s", "size_mb")}
                                              for row in result["rows"]], **counts}
            say(f"mode {mode}: matrix {result['wall_s']:.1f} s; heavy executed {counts['heavy_executed']} "
                f"(duplicates {counts['duplicate_heavy_executions']}); pulled {counts['pulled_bytes'] / 1e6:.1f} MB; "
                f"overhead mean {counts['overhead']['mean_share']:.1%}")
    finally:
        stop_all(state)
        shutil.rmtree(state, ignore_errors=True)
    out["summary"] = summarize(out["modes"])
    write_json(Path(args.out), out)
    say(f"wrote {args.out}: {json.dumps(out['summary'])}")
    return 0


def write_json(path: Path, out: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
