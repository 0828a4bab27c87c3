"""The self-hosted stack: Prefect server on Debian's PostgreSQL 15 with basic auth, then `stoker deploy-flows`
applies deployments/platform.yaml (pools, the GPU limit, the failure automation) and prefect.yaml through
`prefect deploy --all` (both flows with typed parameter forms, the watcher's schedule); a failed run's event
reaches the server's event log. tests/integration/test_prefect_yaml.py checks prefect.yaml in detail."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import pytest
from operate_helpers import ROOT, api_get, prefect_env, stoker

from stoker.stack.prefect_stack import PG_BIN, ensure_postgres, ensure_server
from stoker.stack.services import stop_all

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture(scope="module")
def pg_api(tmp_path_factory):
    # A missing prerequisite fails rather than skips: no case of this module passes without checking anything.
    assert (PG_BIN / "initdb").exists() and shutil.which("runuser") is not None, \
        "PostgreSQL 15 not installed (infra/prefect/stack.sh installs it)"
    state = tmp_path_factory.mktemp("pg-stack")
    db = ensure_postgres(state)
    api = ensure_server(state, database_url=db)
    yield api, db
    stop_all(state)


def test_postgres_backed_server_with_auth_and_deploy_flows(pg_api, tmp_path):
    api, db = pg_api
    assert db.startswith("postgresql+asyncpg://")
    with pytest.raises(urllib.error.HTTPError) as refused:  # no credentials: refused
        urllib.request.urlopen(urllib.request.Request(f"{api.url}/flows/filter", data=b"{}", method="POST",
                                                      headers={"Content-Type": "application/json"}), timeout=10)
    assert refused.value.code == 401

    r = stoker(["deploy-flows"], env=prefect_env(api), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    build = api_get(api, "/deployments/name/build_and_deploy/stoker-cpu")
    assert build["work_pool_name"] == "stoker-cpu"
    # The spec parameter is a typed schema: the UI renders a form, and bad input is refused server-side.
    schema = build["parameter_openapi_schema"]
    assert "spec" in schema["properties"] and "definitions" in schema
    watch = api_get(api, "/deployments/name/watch_revisions/watch")
    assert watch["schedules"][0]["schedule"]["interval"] == 300
    assert watch["parameters"]["watches"][0]["spec"]["model"]["repo_id"]
    assert api_get(api, "/v2/concurrency_limits/gpu-0")["limit"] == 1
    autos = api_get(api, "/automations/filter", {})
    assert any(a["name"] == "stoker-notify-on-failure" for a in autos)

    # A failure event, as a failed run emits it, lands in the server's event log.
    key = uuid.uuid4().hex[:8]
    code = ("from prefect.events import emit_event\n"
            f"emit_event('stoker.run.failed', resource={{'prefect.resource.id': 'stoker.deployment.it-{key}'}},"
            " payload={'error': 'x'})\n"
            "from prefect.events.worker import EventsWorker\nEventsWorker.drain_all()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=prefect_env(api), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import time

    for _ in range(30):
        events = api_get(api, "/events/filter", {"filter": {"event": {"name": ["stoker.run.failed"]}}})
        if any(e["resource"]["prefect.resource.id"] == f"stoker.deployment.it-{key}" for e in events["events"]):
            break
        time.sleep(1)
    else:
        raise AssertionError(json.dumps(events)[:1000])
