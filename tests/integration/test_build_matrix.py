"""A real two-entry matrix (formats none and fp8 of the demo model) through the build_matrix flow, on real
servers (olah Hub mirror, moto S3, Docker + the CPU Triton image, Prefect's temporary API in a new process):
both entries build, evaluate and benchmark; the comparison has a row of numbers per entry; the winner serves
under the spec's own name; the entries' deployments are gone; a rerun's heavy steps are all cache hits."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from operate_helpers import ROOT, make_spec, stoker_env

from stoker.containers import engine as docker_engine

pytestmark = [pytest.mark.prefect]

HEAVY_STEPS = ("fetch", "quantize", "build", "package", "upload", "baseline", "evaluate")
RUN = """
import json, sys
from flows.build_matrix import build_matrix
from stoker.spec.load import parse_spec
spec, formats, promote = parse_spec(json.loads(sys.argv[1])), json.loads(sys.argv[2]), sys.argv[3] == "promote"
print("RESULT " + json.dumps(build_matrix(spec, formats, promote=promote)))
"""


@pytest.fixture
def matrix_spec(local_stack, triton_image):
    name = f"mx-{uuid.uuid4().hex[:6]}"
    data = make_spec(local_stack, name)
    data["quantization"]["calibration"] = {"samples": 4, "seq_len": 32, "batch_size": 4}  # fp8's: a small one
    # Small but real: the evaluation gates each candidate against the unquantized build.
    data["evaluation"] = {"max_windows": 2, "prompts": 2, "window_tokens": 32, "prompt_tokens": 8,
                          "greedy_tokens": 8}
    yield data
    client = docker_engine.connect()
    for n in (name, f"{name}-none", f"{name}-fp8"):
        docker_engine.remove_deployment(client, n, lambda _m: None)


def _run(data: dict, formats: list[str], env: dict, promote: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN, json.dumps(data), json.dumps(formats),
                           "promote" if promote else "no"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def _matrix(data: dict, env: dict, promote: bool = True) -> dict:
    r = _run(data, ["none", "fp8"], env, promote)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _manifests(home: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (home / "runs").glob("*/manifest.json")}


@pytest.mark.docker
@pytest.mark.s3
@pytest.mark.hub
@pytest.mark.slow
def test_a_two_format_matrix_promotes_its_best_and_reruns_from_the_cache(tmp_path, local_stack, matrix_spec,
                                                                         worker_prefect_api):
    data, name = matrix_spec, matrix_spec["deploy"]["name"]
    home, env = tmp_path / "home", stoker_env(tmp_path, worker_prefect_api, local_stack)

    first = _matrix(data, env)
    rows = first["rows"]
    assert [(r["format"], r["status"]) for r in rows] == [("none", "completed"), ("fp8", "completed")], rows
    for r in rows:
        assert r["size_mb"] > 0 and r["output_tokens_per_s"] > 0 and r["ttft_ms_p99"] >= r["ttft_ms_p50"] > 0
        assert r["evaluation"] == "passed" and 0 <= r["greedy_agreement"] <= 1
        assert r["perplexity_delta_pct"] is not None
    assert rows[0]["perplexity_delta_pct"] == pytest.approx(0.0, abs=1e-6)  # unquantized: the baseline itself
    best = first["best"]
    assert best == max(rows, key=lambda r: r["output_tokens_per_s"])
    comparison = Path(first["comparison"])
    table = [ln for ln in comparison.read_text().splitlines() if ln.startswith(("| none |", "| fp8 |"))]
    assert len(table) == 2
    assert json.loads((comparison.parent / "comparison.json").read_text())["rows"] == rows

    # The winner serves under the spec's own name; only its deployment is left.
    assert first["promoted"].startswith(f"{best['format']} on reference → {name}")
    promoted = [m for m in _manifests(home).values() if m["spec"]["deploy"]["name"] == name]
    assert len(promoted) == 1 and promoted[0]["status"] == "completed"
    assert promoted[0]["spec"]["quantization"]["format"] == best["format"]
    assert all(promoted[0]["steps"][s]["cache_hit"] for s in ("fetch", "build", "package", "upload"))
    client = docker_engine.connect()
    assert docker_engine.containers(client, name)
    assert not docker_engine.containers(client, f"{name}-none") and not docker_engine.containers(client, f"{name}-fp8")

    # The rerun compares again without promoting: the promotion's cache hits were proven above.
    seen = set(_manifests(home))
    second = _matrix(data, env, promote=False)
    assert [r["status"] for r in second["rows"]] == ["completed", "completed"] and second["promoted"] is None
    rerun = {k: m for k, m in _manifests(home).items() if k not in seen}
    assert len(rerun) == 2
    for m in rerun.values():
        assert all(st["cache_hit"] for s, st in m["steps"].items() if s in HEAVY_STEPS), {
            s: st["cache_hit"] for s, st in m["steps"].items()}
    assert not docker_engine.containers(client, f"{name}-none") and not docker_engine.containers(client, f"{name}-fp8")


def test_a_duplicated_entry_fails_the_flow_in_one_line_before_any_build(tmp_path, worker_prefect_api):
    data = {"model": {"repo_id": "org/m"}, "storage": {"bucket": "b-1"}, "deploy": {"name": "dup"}}
    r = _run(data, ["none", "fp8", "fp8"], stoker_env(tmp_path, worker_prefect_api))
    assert r.returncode != 0
    assert "matrix entry fp8 on reference: duplicated" in r.stderr
    assert not (tmp_path / "home").exists()  # no fetch, no cache, no run folder
