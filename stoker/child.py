"""Run heavy work (torch, modelopt) in a child process and check how it ended.

The orchestrator never imports torch; a child process also returns all of its
memory to the OS when it exits. Its stderr lines stream into the run's log; its result (the
worker's one JSON line, printed last) is returned, not logged; its progress lines
(`stoker.progress.child_line`) become a bar, plain lines at a cadence, and a Prefect progress artifact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from typing import Callable

from .errors import ChildProcessFailed
from .progress import ChildProgress


def heavy_python() -> str:
    """Interpreter with the `heavy` extra installed (torch, transformers, modelopt)."""
    return os.environ.get("STOKER_HEAVY_PYTHON", sys.executable)


# Library progress bars (transformers' "Loading weights", "Writing model shards") arrive here as
# lines of carriage returns: noise in a run log. A caller's own setting wins.
CHILD_ENV_DEFAULTS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def run_module(module: str, args: list[str], log: Callable[[str], None], timeout_s: float = 3600,
               env: dict[str, str] | None = None, nice: int = 0) -> dict | None:
    """`python -m module args...`; returns the worker's result line (a JSON object) if it printed one last.

    `nice` > 0 lowers the child's CPU priority: background work that must not slow what runs beside it.

    Raises ChildProcessFailed with the child's last line on failure.
    """
    progress = ChildProgress(log)
    try:
        return _run(module, args, progress, timeout_s, env, nice)
    except BaseException:
        progress.close(ok=False)
        raise


def _run(module: str, args: list[str], progress: ChildProgress, timeout_s: float,
         env: dict[str, str] | None, nice: int = 0) -> dict | None:
    log = progress.log
    argv = [heavy_python(), "-m", module, *args]
    tail: deque[str] = deque(maxlen=20)
    child_env = {**CHILD_ENV_DEFAULTS, **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    held: str | None = None  # a line that may be the result: logged only once another line follows
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=child_env, cwd=os.getcwd(), preexec_fn=(lambda: os.nice(nice)) if nice else None) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip()
                if not line or progress.feed(line):
                    continue
                tail.append(line)
                if held is not None:
                    log(held)
                held = line if line.startswith("{") else None
                if held is None:
                    log(line)
            rc = proc.wait(timeout=timeout_s)
            progress.close(ok=rc == 0)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise ChildProcessFailed(f"{module} timed out after {timeout_s:.0f}s") from None
        except BaseException:
            proc.kill()
            raise
    result = _result(held) if rc == 0 else None
    if held is not None and result is None:
        log(held)
    if rc != 0:
        last = next((line for line in reversed(tail) if line.strip()), f"exit status {rc}")
        raise ChildProcessFailed(f"{module} failed (exit {rc}): {last}")
    return result


def _result(line: str | None) -> dict | None:
    try:
        value = json.loads(line) if line else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
