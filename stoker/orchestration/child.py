"""Run heavy work (torch, modelopt) in a child process and check how it ended.

The orchestrator never imports torch; a child process also returns all of its
memory to the OS when it exits. Its stderr lines stream into the run's log; its result (the
worker's one JSON line, printed last) is returned, not logged; its progress lines
(`stoker.record.progress.child_line`) become a bar, plain lines at a cadence, and a Prefect progress artifact.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Callable

from ..errors import ChildProcessFailed
from ..record.progress import ChildProgress


def heavy_python() -> str:
    """Interpreter with the `heavy` extra installed (torch, transformers, modelopt)."""
    return os.environ.get("STOKER_HEAVY_PYTHON", sys.executable)


# Library progress bars (transformers' "Loading weights", "Writing model shards") arrive here as
# lines of carriage returns: noise in a run log. A caller's own setting wins.
CHILD_ENV_DEFAULTS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class Activity:
    """When the child a thread runs last printed anything (a line or a progress update), per thread: the shared
    cache renews a builder's lease only while the builder's own work shows signs of life
    (stoker.cache.lease.Heartbeat), whatever other steps of the process do."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}  # thread id → when its running child last printed

    def begin(self, thread: int) -> None:
        with self._lock:
            self._last[thread] = time.monotonic()

    def touch(self, thread: int) -> None:
        with self._lock:
            self._last[thread] = time.monotonic()

    def end(self, thread: int) -> None:
        with self._lock:
            self._last.pop(thread, None)

    def silent_s(self, thread: int) -> float | None:
        """Seconds since the child ``thread`` runs last printed; None while it runs none (in-process work)."""
        with self._lock:
            last = self._last.get(thread)
        return None if last is None else time.monotonic() - last


ACTIVITY = Activity()


def run_module(module: str, args: list[str], log: Callable[[str], None], timeout_s: float = 3600,
               env: dict[str, str] | None = None, nice: int = 0) -> dict | None:
    """`python -m module args...`; returns the worker's result line (a JSON object) if it printed one last.

    `nice` > 0 lowers the child's CPU priority: background work that must not slow what runs beside it.

    Raises ChildProcessFailed with the child's last line on failure.
    """
    progress = ChildProgress(log)
    me = threading.get_ident()
    ACTIVITY.begin(me)
    try:
        return _run(module, args, progress, timeout_s, env, nice, me)
    except BaseException:
        progress.close(ok=False)
        raise
    finally:
        ACTIVITY.end(me)


def _run(module: str, args: list[str], progress: ChildProgress, timeout_s: float,
         env: dict[str, str] | None, nice: int = 0, caller: int = 0) -> dict | None:
    log = progress.log
    argv = [heavy_python(), "-m", module, *args]
    tail: deque[str] = deque(maxlen=20)
    child_env = {**CHILD_ENV_DEFAULTS, **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    held: str | None = None  # a line that may be the result: logged only once another line follows
    deadline = time.monotonic() + timeout_s
    # Its own session: at the deadline the whole group goes (a worker's own children, e.g. a compiler, too).
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                          cwd=os.getcwd(), start_new_session=True,
                          preexec_fn=(lambda: os.nice(nice)) if nice else None) as proc:
        assert proc.stdout is not None
        # Lines are read on a thread, so that a child that is silent (hung, or sleeping) cannot hold the
        # deadline hostage: the old loop read to EOF before it waited, and a 2 s timeout returned after 40 s.
        lines: queue.Queue[str | None] = queue.Queue()
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines), name=f"child-{module}", daemon=True)
        reader.start()
        try:
            while True:
                try:
                    line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() >= deadline:
                        raise subprocess.TimeoutExpired(argv, timeout_s) from None
                    continue
                if line is None:  # EOF
                    break
                ACTIVITY.touch(caller)
                line = line.rstrip()
                if not line or progress.feed(line):
                    continue
                tail.append(line)
                if held is not None:
                    log(held)
                held = line if line.startswith("{") else None
                if held is None:
                    log(line)
            rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            progress.close(ok=rc == 0)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            last = f"; its last line: {tail[-1]}" if tail else "; it printed nothing"
            raise ChildProcessFailed(f"{module} timed out after {timeout_s:g} s and was killed{last}") from None
        except BaseException:
            _kill_group(proc)
            raise
    result = _result(held) if rc == 0 else None
    if held is not None and result is None:
        log(held)
    if rc != 0:
        last = next((line for line in reversed(tail) if line.strip()), f"exit status {rc}")
        raise ChildProcessFailed(f"{module} failed (exit {rc}): {last}")
    return result


def _pump(stream, lines: queue.Queue) -> None:
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):  # the pipe closed under us when the child was killed
        pass
    finally:
        lines.put(None)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group, then reap it (it may already be gone)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _result(line: str | None) -> dict | None:
    try:
        value = json.loads(line) if line else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
