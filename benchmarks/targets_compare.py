"""One spec as `target: tensorrt` and as `target: pytorch`, each run end to end on the STAND-IN (STOKER_STANDIN=1: no
GPU, no TensorRT-LLM; stoker's own code around a CPU model that speaks each target's contract): per step its time,
cache key, whether it hit, and the artifacts it left with their sizes; writes JSON (docs/targets.md's table).

    .venv/bin/python benchmarks/targets_compare.py --out benchmarks/results/targets_compare.json

The demo's tiny Llama (generated offline) on a Hub mirror and S3 of this script's own, on free ports; each target
in a fresh STOKER_HOME, so every step runs (no cache hit), then once more, to show what the cache keeps. Stand-in
times are stoker's steps around a CPU model: the GPU build times (quantization, trtllm-build, the LLM API's load)
are not measured anywhere here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NGC_IMAGE = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # what the stand-in replaces


def folder_sizes(folder: Path, limit: int = 12) -> dict[str, int]:
    """The largest files under ``folder`` (relative path → bytes) and their total."""
    files = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
    top = dict(sorted(files.items(), key=lambda kv: -kv[1])[:limit])
    return {**top, "(total)": sum(files.values()), "(files)": len(files)}


def spec_for(target: str, hub: str, s3_url: str) -> dict:
    from stoker.demo import DEMO_SPEC
    from stoker.stack.services import free_port

    data = yaml.safe_load(DEMO_SPEC.read_text())
    data.update(target=target, gpus={"type": "h100-80gb", "count": 2, "rollout": "surge"})
    data["model"]["endpoint"] = hub
    data["quantization"] = {"format": "fp8"}
    data["storage"].update(endpoint_url=s3_url, bucket=f"cmp-{uuid.uuid4().hex[:8]}")
    base = free_port()
    data["deploy"].update(name=f"cmp-{target}-{uuid.uuid4().hex[:4]}", image=NGC_IMAGE, settle_s=1, watch_s=3,
                          ports={"http": base, "grpc": free_port(), "metrics": free_port()})
    return data


def run(spec_path: Path, env: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "stoker.cli", "run", str(spec_path)], env=env, capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - t0
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode != 0 or not last.startswith("manifest: "):
        raise SystemExit(f"stoker run {spec_path.name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(Path(last.removeprefix("manifest: ")).read_text()), round(wall, 1)


def steps_of(manifest: dict) -> list[dict]:
    out = []
    for name, step in manifest["steps"].items():
        row = {"step": name, "status": step.get("status"), "s": round(step.get("duration_s") or 0.0, 2),
               "cache_hit": step.get("cache_hit"), "key": (step.get("key") or "")[:24] or None}
        if step.get("outputs"):
            row["artifacts_bytes"] = sum(o["bytes"] for o in step["outputs"])
            row["artifacts"] = len(step["outputs"])
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/targets_compare.json")
    args = parser.parse_args()

    from stoker.containers import engine
    from stoker.demo import ensure_tiny_model
    from stoker.stack.hub_mirror import ensure_mirror, repos_dir
    from stoker.stack.s3server import ensure_s3, s3_env
    from stoker.stack.services import free_port, stop_all

    result: dict = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "standin": True, "targets": {}}
    with tempfile.TemporaryDirectory(prefix="stoker-cmp-") as tmp:
        state = Path(tmp) / "stack"
        ensure_tiny_model(repos_dir(state))
        hub, s3_url = ensure_mirror(state, free_port()), ensure_s3(state, free_port())
        try:
            for target in ("tensorrt", "pytorch"):
                data = spec_for(target, hub, s3_url)
                spec_path = Path(tmp) / f"{target}.yaml"
                spec_path.write_text(yaml.safe_dump(data))
                env = {**os.environ, **s3_env(s3_url), "STOKER_STANDIN": "1",
                       "STOKER_HOME": str(Path(tmp) / f"home-{target}"),
                       "PREFECT_HOME": str(Path(tmp) / f"prefect-{target}"),
                       # a fresh PREFECT_HOME migrates its database first: more than Prefect's default 20 s here
                       "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
                           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")}
                env.pop("PREFECT_API_URL", None)
                try:
                    first, wall1 = run(spec_path, env)
                    again, wall2 = run(spec_path, env)
                finally:
                    engine.remove_deployment(engine.connect(), data["deploy"]["name"], lambda _m: None)
                deploy = first["steps"]["deploy"]["detail"]
                result["targets"][target] = {
                    "run_id": first["run_id"], "wall_s": wall1, "steps": steps_of(first),
                    "rerun": {"wall_s": wall2, "cache_hits": [s["step"] for s in steps_of(again) if s["cache_hit"]]},
                    "repository": folder_sizes(Path(deploy["repository_uri"])),
                    "serving": {"image": deploy.get("image"), "gpus": deploy.get("gpus"),
                                "interface": first.get("serving", {}).get("interface")},
                    "gpu_rollout": first["steps"].get("gpu-rollout", {}).get("detail")}
                print(target, json.dumps({"wall_s": wall1, "rerun_s": wall2}), flush=True)
        finally:
            stop_all(state)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
