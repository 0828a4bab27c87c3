"""Clean logs (issue 14 item 6): the checker catches what a demo used to print, and Prefect's telemetry is off
unless the user turned it on.

The end-to-end check runs in test_flow.py, on the cold run and the rerun it already makes (no extra run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clean_logs import noise

ROOT = Path(__file__).resolve().parents[2]

# Lines a cold `stoker demo` printed before this was fixed (shortened), one of each kind.
NOISY = [
    "14:06:52.303 | ERROR   | prefect.server.services.telemetry - Failed to send telemetry: [Errno -2] Name or "
    "service not known",
    "sqlite3.OperationalError: database is locked",
    "Traceback (most recent call last):",
    "14:07:01.824 | INFO    | Task run 'quantize-a0e' - /x/modelopt/torch/utils/import_utils.py:40: UserWarning: "
    "Failed to import modelopt transformers plugin",
    "14:07:04.720 | INFO    | Task run 'quantize-a0e' -   _warnings.warn(",
    "14:07:04.736 | INFO    | Task run 'quantize-a0e' - [transformers] Token indices sequence length is longer "
    "than the specified maximum sequence length for this model (2544 > 2048).",
    "14:07:06.198 | INFO    | Task run 'quantize-a0e' - [transformers] `torch_dtype` is deprecated! Use `dtype` "
    "instead!",
    "14:07:12.740 | INFO    | Task run 'deploy-354' - [stoker-demo-blue] E1123 14:07:12.739470 1 server.cc:241] "
    '"CudaDriverHelper has not been initialized."',
    "14:07:26.050 | INFO    | Task run 'deploy-354' - [stoker-demo-blue] Error: Failed to initialize NVML",
    "14:07:26.050 | INFO    | Task run 'deploy-354' - [stoker-demo-blue] W1123 14:07:26.032067 1 metrics.cc:798] "
    '"DCGM unable to start: DCGM initialization error"',
    "14:07:26.052 | INFO    | Task run 'deploy-354' - [stoker-demo-blue] +------------------+------+",
    "14:07:26.054 | INFO    | Task run 'deploy-354' - [stoker-demo-blue] | server_id               | triton  |",
    "+----------------------------------+-----------+",
    "| server_version                   | 2.51.0    |",
    "14:20:00.000 | WARNING | Task run 'benchmark-383' - concurrency 4: 16/16 requests failed (16x UNAVAILABLE)",
]

# Lines of a clean run that must pass.
CLEAN = [
    "14:18:21.093 | INFO    | Task run 'benchmark-c56' - concurrency 1: 16/16 ok, 0 errors, 122.1 output tok/s",
    "  concurrency 4: 133.9 output tok/s, TTFT p50 774.78 ms, ITL p50 7.63 ms, errors 0/16",
    "14:18:14.482 | INFO    | Task run 'deploy-97f' - stoker-demo-blue proven: ready after 37.3 s, stayed ready 3 s, "
    "smoke inference streamed 4 responses in 0.37 s (Triton's log: docker logs stoker-demo-blue)",
    "| metric | candidate | baseline | Δ | threshold | pass |",
    "|---|---:|---:|---:|---|---|",
    "14:19:00.000 | WARNING | Task run 'benchmark-1e8' - concurrency 4: the client was saturated (loop lag); these "
    "numbers describe the client rather than the server: use more worker processes",
]


def test_the_checker_flags_each_kind_of_noise_and_passes_a_clean_run():
    assert noise("\n".join(NOISY)) == NOISY
    assert noise("\n".join(CLEAN)) == []


def _settings_in_child(env: dict[str, str]) -> dict:
    """telemetry_off() in a fresh process (Prefect reads its settings once, at import)."""
    code = ("import json, os\n"
            "from stoker.stack.prefect_ephemeral import telemetry_off\n"
            "changed = telemetry_off()\n"
            "from prefect.settings import get_current_settings\n"
            "print(json.dumps({'changed': changed, 'enabled': get_current_settings().server.analytics_enabled,\n"
            "                  'env': os.environ.get('PREFECT_SERVER_ANALYTICS_ENABLED')}))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.prefect
def test_prefect_telemetry_is_off_unless_the_user_set_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_ANALYTICS_ENABLED"}
    env["PREFECT_HOME"] = str(tmp_path / "default")
    # Nothing said: off, in this process's settings and in the environment its temporary API inherits.
    assert _settings_in_child(env) == {"changed": True, "enabled": False, "env": "false"}

    # A profile that turns it on wins.
    home = tmp_path / "profile"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "mine"\n[profiles.mine]\nPREFECT_SERVER_ANALYTICS_ENABLED = "true"\n')
    assert _settings_in_child({**env, "PREFECT_HOME": str(home)}) == {"changed": False, "enabled": True, "env": None}

    # So does the environment.
    assert _settings_in_child({**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "true"}) == {
        "changed": False, "enabled": True, "env": "true"}
