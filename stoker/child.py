"""Run heavy work (torch, modelopt) in a child process and check how it ended.

The orchestrator never imports torch; a child process also returns all of its
memory to the OS when it exits. Its stderr lines stream into the run's log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import deque
from typing import Callable

from .errors import ChildProcessFailed


def heavy_python() -> str:
    """Interpreter with the `heavy` extra installed (torch, transformers, modelopt)."""
    return os.environ.get("STOKER_HEAVY_PYTHON", sys.executable)


def run_module(module: str, args: list[str], log: Callable[[str], None], timeout_s: float = 3600,
               env: dict[str, str] | None = None) -> None:
    """`python -m module args...`; raises ChildProcessFailed with the child's last line on failure."""
    argv = [heavy_python(), "-m", module, *args]
    tail: deque[str] = deque(maxlen=20)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=child_env, cwd=os.getcwd()) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    log(line)
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise ChildProcessFailed(f"{module} timed out after {timeout_s:.0f}s") from None
        except BaseException:
            proc.kill()
            raise
    if rc != 0:
        last = next((line for line in reversed(tail) if line.strip()), f"exit status {rc}")
        raise ChildProcessFailed(f"{module} failed (exit {rc}): {last}")
