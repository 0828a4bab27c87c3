"""A child step's deadline fires whatever the child does: one that printed once and then hangs, one that never
prints. At the deadline its whole process group is killed (a grandchild too), and the error names the step."""

from __future__ import annotations

import os
import sys
import time

import pytest

from stoker.orchestration.child import run_module
from stoker.errors import ChildProcessFailed

HANGING = '''
import subprocess, sys, time
if "--quiet" not in sys.argv:
    print("loaded", flush=True)
# A grandchild that would outlive its parent if only the parent were killed.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[-1], "w").write(str(child.pid))
time.sleep(120)
'''


@pytest.fixture
def hanging_worker(tmp_path, monkeypatch):
    (tmp_path / "stoker_hanging_worker.py").write_text(HANGING)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("STOKER_HEAVY_PYTHON", sys.executable)
    return "stoker_hanging_worker"


def _gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours still answers kill(0): it is dead if its state says so
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("args,last", [([], "its last line: loaded"), (["--quiet"], "it printed nothing")])
def test_a_silent_child_is_killed_at_its_deadline_with_its_children(hanging_worker, tmp_path, args, last):
    pid_file = tmp_path / "grandchild.pid"
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(ChildProcessFailed) as exc:
        run_module(hanging_worker, [*args, str(pid_file)], lines.append, timeout_s=3)
    took = time.monotonic() - t0
    assert str(exc.value) == f"stoker_hanging_worker timed out after 3 s and was killed; {last}"
    # A hang guard, not a speed claim: the child would sleep 120 s; 30 s is ten times the deadline.
    assert took < 30
    assert _gone(int(pid_file.read_text()))
