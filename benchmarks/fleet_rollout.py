"""The fleet rollout measured (issue 52): two Docker engines on this machine, a Prefect process worker per host, the
front HAProxy, the held-out-style load through the front. It runs tests/integration/test_fleet.py (the kit in
tests/integration/fleet_kit.py) with $STOKER_OPERATE_OUT set, so the figures are the ones the test asserts on:

- rollout: build A on both hosts in one wave (the wave's time against each host's own run), then build B wave [east]
  then [west]: per-host switch and retire seconds, each wave's time against its host's own run;
- failed_gate: build D, whose accuracy gate (an lm-eval task score of 1.0) fails on east in wave 1: the run's one
  line, west untouched, both hosts still on B;
- rollback: `stoker rollback NAME --fleet SPEC`, both hosts back to A in one wave: per host its time and run;
- load: one load through the front across those three phases (back to back here; the CI run paces it): 2 gRPC
  clients (a stream per request), a long-lived bidi stream (0.3 s between requests), a busy bidi stream and 2
  HTTP-SSE clients: requests, failed, truncated, per client and per phase;
- host_lost: build C; west's engine stopped once east's run is done: the run fails naming west, east is switched
  back (a routed rollback run on east's worker, `stoker rollback`'s code) to what it served before; the run's time.

Usage: .venv/bin/python benchmarks/fleet_rollout.py [--out benchmarks/results/fleet_rollout.json]
(the service-test environment of docs/testing.md: STOKER_HOME, STOKER_PREFECT_DB_TEMPLATE, ...)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet_rollout.json"))
    args = ap.parse_args()
    raw = Path(tempfile.mkdtemp(prefix="fleet-bench-")) / "raw.json"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--basetemp=/tmp/bt-fleet-bench-{os.getpid()}", "tests/integration/test_fleet.py"],
                       cwd=ROOT, env={**os.environ, "STOKER_OPERATE_OUT": str(raw)}, capture_output=True, text=True)
    data = json.loads(raw.read_text()) if raw.exists() else {}
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    result = {
        "machine": f"{platform.node()}: {os.cpu_count()} cores, no GPU; both Docker engines on this one machine "
                   "(the default dockerd and a second one), one network namespace",
        "tests": {"exit": r.returncode, "summary": tail[0], "wall_s": round(time.monotonic() - t0, 1)},
        **data,
    }
    roll = data.get("rollout") or {}
    if roll:
        hosts = roll.get("hosts", {})
        first = roll.get("first_wave") or {}
        result["wave_vs_host"] = [
            {"run": "A, one wave of both hosts", "hosts": first.get("hosts"), "wave_s": first.get("wave_s"),
             "host_rollout_s": first.get("host_s")},
            *({"run": f"B, wave {w['wave']}", "hosts": w["hosts"], "wave_s": w["seconds"],
               "host_rollout_s": [hosts.get(h, {}).get("seconds") for h in w["hosts"]]} for w in roll.get("waves", []))]
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: result[k] for k in ("tests",)}, indent=1))
    if r.returncode:  # the failing assertion, for whoever reads the benchmark's log
        print("\n".join((r.stdout + r.stderr).splitlines()[-80:]))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
