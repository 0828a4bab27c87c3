"""Two runs of one deployment started at once (a schedule and a webhook together): the second waits for the
first to finish serving — saying so in one line — then deploys (or, had it started before the first, is refused in
one line: an older run never replaces a newer one). Both end with true manifests, and what is left is one proxy and
one backend, serving the run that deployed last. Before the lock, the second run's
reconcile removed the first run's staged candidate and the first failed blaming its own model (issue 25)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from operate_helpers import ROOT, make_spec, prefect_api, prefect_env  # noqa: F401

from stoker.containers import engine as docker_engine

pytestmark = [pytest.mark.prefect, pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.slow]

RUN = r"""
import json, sys
from flows.build_and_deploy import build_and_deploy
from stoker.spec.load import parse_spec
try:
    m = build_and_deploy(parse_spec(json.loads(sys.argv[1]), "it"))
    print("RESULT " + json.dumps({"run_id": m["run_id"], "status": m["status"]}))
except Exception as exc:
    print("FAILED " + json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def test_two_runs_of_one_deployment_serve_one_after_the_other(prefect_api, local_stack, triton_image, tmp_path_factory):
    api, _state = prefect_api
    name = f"one-{os.urandom(3).hex()}"
    spec = make_spec(local_stack, name)
    spec["evaluation"] = {"enabled": False}  # the lock is what is under test, not the gates
    procs = []
    home = tmp_path_factory.mktemp("r")  # one worker's home, as a schedule and a webhook run on one worker
    for i in range(2):
        # Two different builds (another max_batch_size: another repository digest), so the one that deploys
        # last has something of its own to serve.
        spec = {**spec, "triton": {**spec.get("triton", {}), "max_batch_size": 8 if i == 0 else 4}}
        env = {**prefect_env(api), **local_stack["aws_env"], "STOKER_HOME": str(home), "HF_HOME": str(home / "hf")}
        procs.append(subprocess.Popen([sys.executable, "-c", RUN, json.dumps(spec)], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
        results = []
        for out in outs:
            line = next((ln for ln in out.splitlines() if ln.startswith(("RESULT ", "FAILED "))), None)
            assert line, out[-4000:]
            results.append(json.loads(line.split(" ", 1)[1]))
        waited = [i for i, out in enumerate(outs) if f"another run is deploying {name!r}: waiting" in out]
        assert len(waited) == 1, "exactly one run waited for the other"
        first = results[1 - waited[0]]
        assert first.get("status") == "completed", (first, outs[1 - waited[0]][-4000:])
        # The waiting run deploys after it, unless it started before it (stoker/record/ordering.py): then it is
        # refused in one line and the first run's build keeps serving.
        second = results[waited[0]]
        if "error" in second and "an older run does not replace a newer one" in second["error"]:
            assert f"started before run {first['run_id']}" in second["error"], second
            later = first["run_id"]
        else:
            assert second.get("status") == "completed", (second, outs[waited[0]][-4000:])
            later = second["run_id"]

        client = docker_engine.connect(None)
        proxies = docker_engine.containers(client, name, role=docker_engine.ROLE_PROXY)
        backends = docker_engine.containers(client, name, role=docker_engine.ROLE_BACKEND)
        assert len(proxies) == 1
        assert [b.labels[docker_engine.LABEL_RUN] for b in backends] == [later]
    finally:
        for p in procs:
            p.kill()
        docker_engine.remove_deployment(docker_engine.connect(None), name, lambda _m: None)
