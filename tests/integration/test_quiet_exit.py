"""Nothing logs into a closed stream at exit (issue 11: "the exit is noisy").

Prefect stops its temporary API in an atexit hook and logs while doing so; after pytest closed its
capture streams that printed `--- Logging error --- … I/O operation on closed file`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from operate_helpers import stoker

from stoker.demo import DEMO_SPEC

pytestmark = [pytest.mark.prefect]

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "STOKER_HOME": str(tmp_path / "home"),
            "PREFECT_LOGGING_LEVEL": "INFO"}


def test_pytest_running_a_flow_in_process_exits_without_logging_errors(tmp_path):
    case = Path(__file__).with_name("prefect_flow_in_process.py")
    # --basetemp of its own: without it the inner pytest takes a numbered folder under /tmp/pytest-of-<user> and first
    # strips that folder's group and other bits (pytest's tmpdir.py), which cut the postgres user off from the data
    # directory of a PostgreSQL-backed stack another test had running under it (ci70: postgres PANIC, "Permission
    # denied" on pg_control, and the Operate walkthrough's server answered 500 from then on).
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}",
                        str(case)], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout
    assert "Logging error" not in r.stdout + r.stderr, r.stderr[-3000:]


def test_stoker_run_exits_without_logging_errors(tmp_path):
    """A flow that logs, then fails fast in preflight (S3 refused): the whole Prefect life cycle, no servers."""
    data = yaml.safe_load(DEMO_SPEC.read_text())
    data["storage"]["endpoint_url"] = "http://127.0.0.1:9"  # discard port: connection refused
    data.pop("adapters")  # no Hub here: preflight must reach S3, not the adapters' Hub reads
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    r = stoker(["run", str(spec)], env=_env(tmp_path), timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Beginning flow run" in r.stderr  # Prefect really logged
    assert r.stderr.strip().splitlines()[-1].startswith("stoker: error: ")
    assert "Logging error" not in r.stdout + r.stderr, r.stderr[-3000:]
