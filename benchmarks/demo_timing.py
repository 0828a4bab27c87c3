"""Cold `stoker demo` vs an immediate rerun, side by side in one run; writes JSON.

Cold = a fresh STOKER_HOME and PREFECT_HOME (tiny model generated, every step
runs); the CPU Triton image is assumed built (its build time is separate).
Reports each step's duration and the flow's overhead (wall − Σ steps) from the
run manifests, and the whole command's wall time.

    python benchmarks/demo_timing.py --out benchmarks/results/demo_timing.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_demo(env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "stoker.cli", "demo"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"demo failed: {r.stderr.strip().splitlines()[-1]}")
    path = r.stdout.strip().splitlines()[-1].removeprefix("manifest: ")
    return wall, json.loads(Path(path).read_text())


def summary(wall: float, m: dict) -> dict:
    steps = {k: {"duration_s": v["duration_s"], "cache_hit": v["cache_hit"]} for k, v in m["steps"].items()}
    return {"command_wall_s": round(wall, 2), "flow_wall_s": m["wall_s"], "flow_overhead_s": m["overhead_s"],
            "steps": steps, "benchmark": m["benchmark"]["levels"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_timing.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "STOKER_HOME": f"{tmp}/home", "PREFECT_HOME": f"{tmp}/prefect"}
        cold_wall, cold = run_demo(env)
        warm_wall, warm = run_demo(env)
        subprocess.run([sys.executable, "-m", "stoker.cli", "down"], env=env, capture_output=True)
    result = {"cold": summary(cold_wall, cold), "rerun": summary(warm_wall, warm),
              "cold_over_rerun": round(cold_wall / warm_wall, 2),
              "note": "same machine, same run, image prebuilt; cold includes tiny-model generation and a fresh "
                      "Prefect database"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("cold_over_rerun",)} | {
        "cold_s": result["cold"]["command_wall_s"], "rerun_s": result["rerun"]["command_wall_s"]}))


if __name__ == "__main__":
    main()
