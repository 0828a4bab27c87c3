"""The gate and promote tasks against a real S3 (moto) inside a real Prefect flow (ephemeral API, own home)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from stoker.storage import s3
from stoker.spec.schema import Storage

pytestmark = [pytest.mark.s3, pytest.mark.prefect]

SCRIPT = r'''
import json, sys
from pathlib import Path
from prefect import flow
from stoker.bench.errors import GateFailed
from stoker.run import RunContext, StepResult
from stoker.spec.load import parse_spec
from tasks.gate import gate_benchmark, promote_run

spec = parse_spec(json.loads(sys.argv[1]))
good, worse, home = json.loads(sys.argv[2]), json.loads(sys.argv[3]), Path(sys.argv[4])

@flow
def gate_then_promote(detail: dict, run_id: str) -> str:
    ctx = RunContext(run_id=run_id, home=home)
    bench = StepResult(name="benchmark", detail=detail)
    try:
        gate_benchmark(spec, bench, ctx)
    except GateFailed as exc:
        return "FAILED " + str(exc)
    promote_run(spec, bench, ctx)
    return "PROMOTED"

print(gate_then_promote(good, "run-1"))
print(gate_then_promote(worse, "run-2"))
print((home / "runs" / "run-2" / "benchmark" / "gate.md").read_text())
'''


def _level(c: int, tok_s: float, ttft_p99: float) -> dict:
    return {"mode": "concurrency", "concurrency": c, "request_rate": None, "requests": 8, "errors": 0,
            "output_tokens_per_s": tok_s, "ttft_ms": {"p99": ttft_p99}, "itl_ms": {"p99": 5.0}}


def test_failed_gate_is_not_promoted_and_says_what_regressed(local_stack, tmp_path, monkeypatch) -> None:
    for key, value in local_stack["aws_env"].items():
        monkeypatch.setenv(key, value)
    storage = {"bucket": "stoker-gate-test", "prefix": "gate", "endpoint_url": local_stack["s3"]}
    spec = {"model": {"repo_id": "stoker/tiny-llama"}, "storage": storage, "deploy": {"name": "gate-test"},
            "benchmark": {"gate": {"enabled": True}}}
    env = {**os.environ, **local_stack["aws_env"], "PREFECT_HOME": str(tmp_path / "prefect")}
    client = s3.client(Storage(**storage))
    client.create_bucket(Bucket=storage["bucket"])
    workload = {"prompts": {"isl": 32, "osl": 16}, "protocol": "grpc"}
    good = {"workload": workload, "levels": [_level(1, 100.0, 40.0), _level(2, 180.0, 50.0)]}
    worse = {"workload": workload, "levels": [_level(1, 99.0, 41.0), _level(2, 150.0, 50.0)]}  # c=2: -16.7 %
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(spec), json.dumps(good), json.dumps(worse),
                          str(tmp_path / "home")], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0] == "PROMOTED"  # first run: no baseline, no errors
    assert lines[1].startswith("FAILED benchmark regressed against baseline run run-1: concurrency 2 "
                               "output_tokens_per_s 180.00 → 150.00 (-16.7 %, limit >= -5 %)")
    assert "| concurrency 2 | output_tokens_per_s | 180.00 | 150.00 | -16.7 % | >= -5 % | **regressed** |" in run.stdout
    baseline = s3.get_json(client, Storage(**storage), s3.baseline_key(Storage(**storage), "gate-test"))
    assert baseline is not None and baseline["run_id"] == "run-1"  # the regressed run was not promoted
    assert baseline["levels"][1]["output_tokens_per_s"] == 180.0
    assert s3.get_json(client, Storage(**storage), "gate/deployments/other/baseline.json") is None
