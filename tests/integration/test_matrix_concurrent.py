"""Two matrix runs of one spec started at once, on a real `prefect server start`, each in its own process with its
own STOKER_HOME, sharing the Prefect API and the S3 step cache (moto): the Prefect concurrency limit of the
deployment name lets one run the entries while the other waits; the second then finds every heavy step in the
shared cache, and both report the same digests."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from operate_helpers import ROOT, api_get, make_spec, prefect_api, prefect_env  # noqa: F401

from stoker.containers import engine as docker_engine

pytestmark = [pytest.mark.prefect, pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.slow]

HEAVY = ("fetch", "quantize", "build", "package")
RUN = """
import json, sys
from flows.build_matrix import build_matrix
from stoker.spec.load import parse_spec
print("RESULT " + json.dumps(build_matrix(parse_spec(json.loads(sys.argv[1])), ["none"], promote=False)))
"""


def _manifests(home: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (home / "runs").glob("*/manifest.json")]


def test_two_matrices_of_one_spec_at_once_build_once_and_agree(prefect_api, local_stack, triton_image, tmp_path):
    api, _state = prefect_api
    name = f"mc-{uuid.uuid4().hex[:6]}"
    data = make_spec(local_stack, name)
    data["storage"].update(shared_cache=True, create_bucket=True)
    data["evaluation"] = {"enabled": False}
    env = prefect_env(api) | local_stack["aws_env"]
    procs = []
    try:
        for who in ("a", "b"):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", RUN, json.dumps(data)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, env=env | {"STOKER_HOME": str(tmp_path / who)}))
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        docker_engine.remove_deployment(docker_engine.connect(), f"{name}-none", lambda _m: None)
    results = []
    for out in outs:
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        assert line, out[-4000:]
        results.append(json.loads(line.removeprefix("RESULT ")))
    assert all(r["rows"][0]["status"] == "completed" for r in results), results

    # One waited for the other, then found every heavy step in the shared cache: each ran exactly once.
    waited = [out for out in outs if f"another matrix of '{name}' is running: waiting" in out]
    assert len(waited) == 1, [o[-2000:] for o in outs]
    runs = {who: _manifests(tmp_path / who) for who in ("a", "b")}
    assert all(len(ms) == 1 for ms in runs.values()), runs
    layers = {who: {s: ms[0]["steps"][s]["layer"] for s in HEAVY} for who, ms in runs.items()}
    assert sorted(tuple(sorted(set(v.values()))) for v in layers.values()) == [("built",), ("remote",)], layers
    # Both report the same digests for every heavy step.
    digests = [{s: ms[0]["steps"][s]["digest"] for s in HEAVY} for ms in runs.values()]
    assert digests[0] == digests[1] and all(digests[0].values())
    limit = api_get(api, f"/v2/concurrency_limits/stoker-matrix-{name}")
    assert limit["limit"] == 1 and limit["active_slots"] == 0
