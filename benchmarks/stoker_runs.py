"""What the benchmarks that run `stoker` end to end share (quality.py, lora.py): the CLI in a child process as a user
runs it, timed; the run's manifest; a spec written with changes; the deployments a benchmark started, removed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml


def stoker(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "stoker.cli", *args], env=env, capture_output=True, text=True,
                       timeout=1800)
    return time.perf_counter() - t0, r


def manifest_of(r: subprocess.CompletedProcess, home: Path, since: float) -> dict:
    """The run's manifest: the last line names it on success; on failure, the run folder written since."""
    last = (r.stdout.strip().splitlines() or [""])[-1]
    if last.startswith("manifest: "):
        return json.loads(Path(last.removeprefix("manifest: ")).read_text())
    runs = sorted((p for p in (home / "runs").glob("*/manifest.json") if p.stat().st_mtime >= since),
                  key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit(f"no manifest; stderr: {r.stderr.strip()[-2000:]}")
    return json.loads(runs[-1].read_text())


def write_spec(base: dict, path: Path, **changes) -> Path:
    data = json.loads(json.dumps(base))
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path.write_text(yaml.safe_dump(data))
    return path


def cleanup(names: list[str]) -> None:
    from stoker.containers.engine import connect, remove_deployment

    client = connect()
    for name in names:
        remove_deployment(client, name, lambda _l: None)
    subprocess.run([sys.executable, "-m", "stoker.cli", "down"], capture_output=True)
    names.clear()
