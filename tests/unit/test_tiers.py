"""A test in the wrong tier fails `make test-fast` in one line naming it (tests/tiers.py), checked by running
pytest on planted tests next to a copy of the suite's conftest."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FAST = "not (docker or triton or s3 or hub or prefect or slow)"


def _pytest(tmp_path: Path, name: str, body: str) -> subprocess.CompletedProcess:
    suite = tmp_path / "tests"
    suite.mkdir()
    for f in ("conftest.py", "tiers.py"):
        shutil.copy(TESTS / f, suite / f)
    (suite / name).write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", FAST,
                           "-c", str(TESTS.parent / "pyproject.toml"), "--rootdir", str(tmp_path), str(suite)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_a_fast_test_that_starts_a_service_errors_naming_itself(tmp_path):
    r = _pytest(tmp_path, "test_planted.py", "import subprocess\n\ndef test_sneaky():\n"
                "    subprocess.Popen(['moto_server', '-p', '1'])\n")
    assert r.returncode == 1
    assert ("RuntimeError: tier: tests/test_planted.py::test_sneaky is in the fast tier (no service marker) but "
            "starts moto_server") in r.stdout


def test_a_fast_test_that_runs_a_flow_without_an_api_errors_naming_itself(tmp_path):
    """A flow with no API configured starts Prefect's temporary API (a uvicorn process): a service."""
    r = _pytest(tmp_path, "test_planted.py", "from prefect import flow\n\n@flow\ndef f():\n    return 1\n\n"
                "def test_sneaky(monkeypatch, tmp_path):\n    monkeypatch.delenv('PREFECT_API_URL', raising=False)\n"
                "    monkeypatch.setenv('PREFECT_HOME', str(tmp_path))\n    f()\n")
    assert r.returncode == 1
    assert ("tier: tests/test_planted.py::test_sneaky is in the fast tier (no service marker) but starts Prefect's "
            "temporary API") in r.stdout, r.stdout[-3000:]


def test_a_fast_test_that_requests_a_service_fixture_fails_collection(tmp_path):
    r = _pytest(tmp_path, "test_planted.py", "def test_sneaky(local_stack):\n    assert local_stack\n")
    assert r.returncode != 0
    assert "tier: tests/test_planted.py: uses a service fixture without a service marker" in r.stdout + r.stderr


def test_a_marked_test_is_left_alone(tmp_path):
    r = _pytest(tmp_path, "test_planted.py", "import pytest\n\n@pytest.mark.s3\ndef test_ok(local_stack):\n"
                "    pass\n")
    assert r.returncode == 5 and "1 deselected" in r.stdout  # not in the fast tier: not collected into it


def test_a_skip_not_on_the_allowed_list_fails_the_run_naming_the_file(tmp_path):
    r = _pytest(tmp_path, "test_planted.py", "import pytest\n\ndef test_quiet():\n    pytest.skip('not here')\n\n"
                "def test_real():\n    assert True\n")
    assert r.returncode == 1, r.stdout
    assert "skips: tests/test_planted.py: 1 skip(s) not in tests/allowed_skips.txt (tests/test_planted.py::test_quiet)" \
        in r.stdout
