"""prefect.yaml against a real `prefect server start` (SQLite, basic auth): `stoker deploy-flows` (platform.yaml,
then `prefect deploy --all`) writes both deployments with their pool, pull step, typed parameter schema, the
watcher's schedule and concurrency, the build trigger and the automations; `prefect deploy --all` by itself
re-applies in place; a `stoker.build.requested` event naming a spec of deployments/specs starts one build_named run,
and one carrying a spec or a path starts none."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from operate_helpers import ROOT, api_get, deployment_id, flow_runs, prefect_api, prefect_env, stoker  # noqa: F401

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def _prefect(api, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).with_name("prefect")), "--no-prompt", *args], cwd=ROOT,
                          env=prefect_env(api), capture_output=True, text=True, timeout=300)


def _automations(api) -> dict[str, list[dict]]:
    named: dict[str, list[dict]] = {}
    for a in api_get(api, "/automations/filter", {}):
        named.setdefault(a["name"], []).append(a)
    return named


@pytest.fixture(scope="module")
def deployed(prefect_api):
    api, _state = prefect_api
    r = stoker(["deploy-flows"], env=prefect_env(api), timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "applied 5 deployment(s) of prefect.yaml: stoker-cpu, event, matrix, gpu, watch"
    return api


def test_deploy_flows_writes_every_deployment_of_prefect_yaml(deployed):
    from flows.watch_revisions import Watch

    api = deployed
    build = api_get(api, "/deployments/name/build_and_deploy/stoker-cpu")
    assert build["work_pool_name"] == "stoker-cpu" and build["enforce_parameter_schema"] is True
    # The pull step enters this checkout (the build step's `pwd` at deploy time).
    assert build["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    schema = build["parameter_openapi_schema"]
    assert schema["required"] == ["spec"]
    assert schema["properties"]["spec"]["$ref"] == "#/definitions/Spec"
    assert schema["definitions"]["Storage"]["required"] == ["bucket"]
    assert schema["definitions"]["Quantization"]["properties"]["format"]["enum"][:2] == ["none", "fp8"]

    matrix = api_get(api, "/deployments/name/build_matrix/matrix")
    assert matrix["work_pool_name"] == "stoker-cpu" and matrix["enforce_parameter_schema"] is True
    assert matrix["parameter_openapi_schema"]["required"] == ["spec", "formats"]

    watch = api_get(api, "/deployments/name/watch_revisions/watch")
    assert [s["schedule"]["interval"] for s in watch["schedules"]] == [300]
    assert watch["global_concurrency_limit"] is None  # overlapping ticks are deduplicated by idempotency key
    watches = [Watch.model_validate(w) for w in watch["parameters"]["watches"]]
    assert watches[0].spec.model.repo_id == "stoker/tiny-llama"
    assert watches[0].deployment == "build_and_deploy/stoker-cpu"

    assert api_get(api, "/v2/concurrency_limits/gpu-0")["limit"] == 1
    autos = _automations(api)
    assert len(autos["stoker-notify-on-failure"]) == 1
    (trigger,) = autos["stoker-build-requested"]
    event = api_get(api, "/deployments/name/build_named/event")
    assert trigger["actions"][0]["type"] == "run-deployment"
    assert trigger["actions"][0]["deployment_id"] == event["id"]  # the by-name flow, never stoker-cpu itself
    assert event["parameter_openapi_schema"]["properties"]["spec"]["type"] == "string"

    # The Prefect way by itself, on the same file: updates in place (no second trigger, same deployment).
    r = _prefect(api, "deploy", "--all")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert api_get(api, "/deployments/name/build_and_deploy/stoker-cpu")["id"] == build["id"]
    assert len(_automations(api)["stoker-build-requested"]) == 1


def _emit(api, resource: str, payload: dict) -> None:
    r = _prefect(api, "event", "emit", "stoker.build.requested", "--resource-id", resource,
                 "--payload", json.dumps(payload))
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]


def test_build_requested_event_names_a_spec_of_the_folder_and_never_carries_one(deployed):
    """An event starts build_named with a spec's name and a revision; one carrying a whole spec (its own image, Docker
    host, open address) or a path is refused by the server's schema check and starts nothing."""
    api = deployed
    dep = deployment_id(api, "build_named", "event")
    tag = uuid.uuid4().hex[:6]
    _emit(api, f"stoker.build.ok-{tag}", {"spec": "example-full", "revision": f"rev-{tag}"})
    spec = yaml.safe_load((ROOT / "stoker/demo.yaml").read_text())
    spec["deploy"] |= {"name": f"evt-{tag}", "address": "0.0.0.0", "allow_unauthenticated": True}
    _emit(api, f"stoker.build.whole-{tag}", {"spec": spec, "revision": "main"})
    _emit(api, f"stoker.build.path-{tag}", {"spec": "../../etc/passwd", "revision": "main"})

    deadline = time.monotonic() + 90
    while True:
        mine = [r for r in flow_runs(api, dep) if tag in json.dumps(r["parameters"])]
        reasons = [e["payload"].get("reason", "") for e in api_get(api, "/events/filter", {"filter": {
            "event": {"name": ["prefect.automation.action.failed"]}}})["events"]]
        whole = [r for r in reasons if f"evt-{tag}" in r and "is not of type 'string'" in r]
        path = [r for r in reasons if "'../../etc/passwd' does not match" in r]
        if mine and whole and path:
            break
        assert time.monotonic() < deadline, f"runs {mine}, failures {reasons}"
        time.sleep(1)
    time.sleep(2)  # a late run of a refused event would show here
    runs = flow_runs(api, dep)
    assert [r["parameters"] for r in runs if tag in json.dumps(r["parameters"])] == [
        {"spec": "example-full", "revision": f"rev-{tag}"}]
    assert not [r for r in runs if not isinstance(r["parameters"].get("spec"), str) or "/" in r["parameters"]["spec"]]
