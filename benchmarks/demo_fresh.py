"""`make demo` from a fresh clone, phase by phase: the packages the demo needs, the Docker engine, the CPU Triton
image built from nothing, the first run; writes JSON.

    python3 benchmarks/demo_fresh.py --out benchmarks/results/demo_timing.json

A fresh clone in a temporary folder with its own .venv and STOKER_HOME (no rootfs cache, no step cache, no Prefect
database); pip downloads every package again (PIP_NO_CACHE_DIR); the image is built under a tag of its own, so the
whole registry-free recipe runs (debootstrap included). What a fresh machine would still add and this one cannot
undo is recorded as such: Debian's docker.io already installed and dockerd running, torch's CPU wheel in the local
wheel folder. Stop a running demo first (`stoker down`): the demo's ports are fixed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 300.0


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    return round(seconds, 1), done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/demo_timing.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stoker-demo-fresh-") as tmp:
        clone = Path(tmp) / "stoker"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()
        env = {**os.environ, "STOKER_HOME": str(Path(tmp) / "home"), "PREFECT_HOME": str(Path(tmp) / "prefect"),
               "PIP_NO_CACHE_DIR": "1"}
        env.pop("PREFECT_API_URL", None)
        tag = f"stoker/triton-cpu:fresh-{int(time.time())}"
        phases = {}
        # make demo = make setup (the venv, the engine and the image side by side), then stoker demo.
        phases["setup_s"], setup_out = timed(["make", "setup", f"IMAGE={tag}"], clone, env)
        phases["first_run_s"], out = timed(["make", "demo", f"IMAGE={tag}"], clone, env)
        subprocess.run([str(clone / ".venv/bin/stoker"), "down"], cwd=clone, env=env, capture_output=True)
        subprocess.run(["docker", "rmi", tag], capture_output=True)
    total = round(sum(phases.values()), 1)
    result = {
        "what": "make demo on a fresh clone, by phase (setup: make setup with pip's cache off, the venv's packages "
                "and the CPU Triton image from nothing (rootfs cache empty) side by side, then the HAProxy image; "
                "first run: make demo once set up, i.e. stoker demo in a fresh STOKER_HOME and PREFECT_HOME)",
        "commit": commit, **phases, "total_s": total, "target_total_s": TARGET_S, "met": total <= TARGET_S,
        "already_here": ["Debian's docker.io installed and dockerd running (make docker found it)",
                         "torch 2.13.0's CPU wheel in the local wheel folder (pip's find-links)"],
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": list(os.getloadavg())},
        "setup_tail": setup_out.strip().splitlines()[-4:],
        "demo_tail": out.strip().splitlines()[-6:],
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.endswith("_s") or k == "met"}))


if __name__ == "__main__":
    main()
