"""The demo leaves a Prefect UI up (issue 14 item 4), proven in a real browser.

A cold `stoker demo` in a fresh STOKER_HOME starts its own Prefect server (SQLite, UI), a process worker and
`build_and_deploy/demo`, prints the run's UI address and clean logs. Then headless chromium (Debian's, driven
by selenium through chromium-driver) opens the deployment's form, submits it, follows the new run to
Completed and finds the run's report and benchmark among its artifacts. `stoker down` stops the server.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest
from clean_logs import noise
from operate_helpers import stoker

import prefect_ui
from stoker.stack.services import free_port, port_open

pytestmark = [pytest.mark.docker, pytest.mark.prefect, pytest.mark.slow]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> list | dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_demo_leaves_a_prefect_ui_where_a_form_run_completes(tmp_path, triton_image):
    assert (reason := prefect_ui.missing()) is None, reason  # a missing browser fails: infra/test-deps.sh installs it
    ui_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}  # no server of the caller's
    env.update(STOKER_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect-client"),
               STOKER_DEMO_PREFECT_PORT=str(ui_port), STOKER_DEMO_HUB_PORT=str(free_port(exclude=(ui_port,))))
    env["STOKER_DEMO_S3_PORT"] = str(free_port(exclude=(ui_port, int(env["STOKER_DEMO_HUB_PORT"]))))
    ui = f"http://127.0.0.1:{ui_port}"
    try:
        demo = stoker(["demo"], env, timeout=900)
        assert demo.returncode == 0, demo.stderr[-4000:]
        assert noise(demo.stdout + demo.stderr) == []
        line = next(x for x in demo.stdout.splitlines() if x.startswith("Prefect:"))
        run_id = re.search(rf"{re.escape(ui)}/runs/flow-run/([0-9a-f-]{{36}})", line).group(1)
        # The demo's own run is on the server, completed, under the demo's deployment's flow.
        assert _get(f"{ui}/api/flow_runs/{run_id}")["state_type"] == "COMPLETED"
        deployment = _get(f"{ui}/api/deployments/name/build_and_deploy/demo")
        assert deployment["work_pool_name"] == "stoker-demo"
        assert "spec" in deployment["parameter_openapi_schema"]["properties"]  # the UI renders it as a form

        def new_runs() -> list[str]:
            runs = _post(f"{ui}/api/flow_runs/filter",
                         {"flow_runs": {"deployment_id": {"any_": [deployment["id"]]}}})
            return [r["name"] for r in runs if r["id"] != run_id]

        driver = prefect_ui.browser()
        try:
            name = prefect_ui.submit_custom_run(driver, ui, deployment["id"], new_runs)  # defaults: the demo spec
            url = prefect_ui.open_run(driver, name)
            assert prefect_ui.wait_final_state(driver, timeout_s=600) == "completed", url
            artifacts = prefect_ui.open_tab(driver, "Artifacts")
            assert "stoker-demo-report" in artifacts and "stoker-demo-benchmark" in artifacts, artifacts[-2000:]
        finally:
            driver.quit()
        # The browser's run is a real run of the deployment, executed by the demo's process worker.
        form_run = _get(url.replace("/runs/flow-run/", "/api/flow_runs/"))
        assert form_run["deployment_id"] == deployment["id"] and form_run["state_type"] == "COMPLETED"
    finally:
        down = stoker(["down"], env, timeout=300)
    assert down.returncode == 0, down.stderr
    assert "stopped prefect-server" in down.stdout, down.stdout
    assert not port_open(ui_port)
