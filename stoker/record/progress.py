"""Progress of long work: a bar on a terminal, plain lines in a log, a progress artifact in a Prefect run.

One `Progress` per piece of work with a known total: bytes downloaded or uploaded, calibration batches,
image build steps. On a terminal (stderr is a TTY) it draws a tqdm bar; otherwise it logs a plain line
every 10 % or 5 s, never one per file or chunk. Inside a Prefect task or flow run it also keeps a
progress artifact up to date (at most once a second, and at the end); outside a run it touches nothing
of Prefect's. It is thread-safe: an upload's threads all report into one.

A child process cannot draw into its parent's terminal or artifacts: it prints `child_line(...)` lines
(`stoker-progress {"label": "calibration pass 1", "done": 3, "total": 4, "unit": "batch"}`) and the
parent's `ChildProgress` (`stoker.orchestration.child.run_module`) turns them into a `Progress`.
"""

from __future__ import annotations

import contextvars
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from tqdm import tqdm

PREFIX = "stoker-progress "
LINE_EVERY_PCT = 10
LINE_EVERY_S = 5.0
ARTIFACT_EVERY_S = 1.0  # each artifact update is an API call: a sub-second step costs two (start, end)
_PLURALS = {"batch": "batches", "step": "steps", "file": "files"}
_log = logging.getLogger(__name__)


class ArtifactSink(Protocol):
    """Where a Progress reports its percentage besides the terminal (a Prefect progress artifact)."""

    def update(self, percent: float, description: str) -> None: ...


AUTO: Any = object()  # Progress(artifact=AUTO): a Prefect artifact inside a run, none outside


class Progress:
    """Progress of one piece of work of `total` `unit`s ("B" for bytes, else a count such as "batch").

    `advance(n)` adds (n may be negative: a retried part), `update(done)` sets; both from any thread.
    `close(ok)` (or leaving a `with` block) ends it: on success it counts as complete.
    `lines=False` for work whose own log lines already say where it is (an image build's steps): then only
    the bar and the artifact show it.
    """

    def __init__(self, label: str, total: float, unit: str = "B", log: Callable[[str], None] = print, *,
                 stream: TextIO | None = None, tty: bool | None = None, lines: bool = True,
                 artifact: ArtifactSink | None = AUTO, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.unit, self.total = label, unit, max(0.0, float(total))
        self._log, self._lines, self._clock = log, lines, clock
        self._stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()  # the counters and the bar
        self._emit_lock = threading.Lock()  # lines and artifact updates go out one at a time, in order
        self._done = 0.0
        self._note = ""
        self._started = clock()
        self._line_step, self._line_t, self._line_done = 0, self._started, 0.0
        self._artifact_t = self._started
        self._said = 0.0  # the amount the last line (or artifact update) showed
        self._closed = False
        self._bar = self._make_bar() if (_is_tty(self._stream) if tty is None else tty) else None
        if artifact is AUTO:
            artifact = _RunArtifact.start(self.describe(0.0)) if in_prefect_run() else None
        self._artifact = artifact

    # ---- reporting -----------------------------------------------------------------------------------

    def advance(self, n: float) -> None:
        with self._lock:
            self._set(self._done + n)
        self._maybe_emit()

    def update(self, done: float, note: str | None = None) -> None:
        with self._lock:
            if note is not None and not self._closed:
                self._note = note
                if self._bar is not None:
                    self._bar.set_postfix_str(note, refresh=False)
            self._set(done)
        self._maybe_emit()

    def share(self, size: float) -> _Share:
        """A callback for one part of the work (a file of `size` bytes): it adds what it is called with, never
        more than `size` in all nor below 0 (retries count back); its `.complete()` adds what is left."""
        return _Share(self, size)

    def close(self, ok: bool = True) -> None:
        with self._lock:
            if self._closed:
                return
            if ok:
                self._set(self.total)
            self._closed = True
        with self._emit_lock:
            done = self._done
            text = self.describe(done, final=True) if ok else f"{self.label}: stopped at {self._amount(done)}"
            if self._bar is not None:
                self._bar.close()
            elif self._lines and ok:
                self._log(text)
            self._send_artifact(done, text)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)

    def printer(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, made to write around the bar on a terminal (the bar is cleared, the line written, the bar
        drawn again) so log lines and the bar do not overwrite each other."""
        if self._bar is None:
            return log

        def write(line: str) -> None:
            with tqdm.external_write_mode(file=self._stream):
                log(line)

        return write

    # ---- what it says --------------------------------------------------------------------------------

    @property
    def done(self) -> float:
        return self._done

    def percent(self, done: float) -> float:
        return 100.0 if self.total <= 0 else max(0.0, min(100.0, 100.0 * done / self.total))

    def describe(self, done: float, final: bool = False) -> str:
        """'upload: 2.6/26.2 MB (10%)'; the final one adds the time taken."""
        took = f", {self._clock() - self._started:.1f} s" if final else ""
        note = f": {self._note}" if self._note else ""
        return f"{self.label}: {self._amount(done)} ({self.percent(done):.0f}%{took}){note}"

    def _amount(self, done: float) -> str:
        if self.unit == "B":
            scale, name = next(((s, n) for s, n in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if self.total >= s),
                               (1, "B"))
            return f"{done / scale:.1f}/{self.total / scale:.1f} {name}"
        name = _PLURALS.get(self.unit, self.unit) if self.total != 1 else self.unit
        return f"{done:.0f}/{self.total:.0f} {name}"

    # ---- inside ----------------------------------------------------------------------------------------

    def _set(self, done: float) -> None:  # holds self._lock
        if self._closed:  # a late callback of a finished or failed upload
            return
        done = max(0.0, done)
        if self._bar is not None and done != self._done:
            self._bar.update(done - self._done)
        self._done = done

    def _maybe_emit(self) -> None:
        now = self._clock()
        with self._lock:
            if self._closed:
                return
            done = self._done
            if done >= self.total:  # the end is close()'s to say, with the time it took
                return
            step = math.floor(self.percent(done) / LINE_EVERY_PCT)
            line_due = step > self._line_step or (now - self._line_t >= LINE_EVERY_S and done != self._line_done)
            artifact_due = self._artifact is not None and line_due and now - self._artifact_t >= ARTIFACT_EVERY_S
            if not line_due:
                return
            self._line_step, self._line_t, self._line_done = max(step, self._line_step), now, done
            if artifact_due:
                self._artifact_t = now
        with self._emit_lock:
            done = self._done  # the newest value, so lines and artifact updates keep their order
            if self._closed or done >= self.total or done == self._said:
                return
            self._said = done
            text = self.describe(done)
            if self._lines and self._bar is None:
                self._log(text)
            if artifact_due:
                self._send_artifact(done, text)

    def _send_artifact(self, done: float, text: str) -> None:  # holds self._emit_lock
        if self._artifact is None:
            return
        try:
            self._artifact.update(self.percent(done), text)
        except Exception as err:  # noqa: BLE001 - progress is a view of the work: it never fails the work
            _log.debug("progress artifact update failed, no more updates: %s", err)
            self._artifact = None

    def _make_bar(self) -> tqdm:
        if self.unit == "B":
            return tqdm(total=self.total, desc=self.label, unit="B", unit_scale=True, unit_divisor=1000,
                        file=self._stream, leave=True, dynamic_ncols=True, mininterval=0.2)
        return tqdm(total=self.total, desc=self.label, unit=f" {self.unit}", file=self._stream, leave=True,
                    dynamic_ncols=True, mininterval=0.2)


class _Share:
    def __init__(self, progress: Progress, size: float) -> None:
        self._progress, self._size, self._sent = progress, float(size), 0.0
        self._lock = threading.Lock()  # s3transfer calls one file's callback from several threads

    def __call__(self, n: float) -> None:
        with self._lock:
            n = max(-self._sent, min(float(n), self._size - self._sent))
            self._sent += n
        if n:
            self._progress.advance(n)

    def complete(self) -> None:
        with self._lock:
            left, self._sent = self._size - self._sent, self._size
        if left:
            self._progress.advance(left)


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def in_prefect_run() -> bool:
    """True inside a Prefect task or flow run. Never imports Prefect: a process that has not imported it
    (a child worker, a plain CLI command) is in no run."""
    if "prefect.context" not in sys.modules:
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


class _RunArtifact:
    """A Prefect progress artifact of the current run. Updates may come from other threads (an upload's):
    they run in a copy of the creating thread's context, which holds the run and the API client settings."""

    def __init__(self, artifact_id: Any, context: contextvars.Context) -> None:
        self._id, self._context = artifact_id, context

    @classmethod
    def start(cls, description: str) -> _RunArtifact | None:
        from prefect.artifacts import create_progress_artifact

        try:
            artifact_id = create_progress_artifact(0.0, description=description, _sync=True)  # also from async code
        except Exception as err:  # noqa: BLE001 - as in Progress._send_artifact
            _log.debug("progress artifact not created: %s", err)
            return None
        return cls(artifact_id, contextvars.copy_context())

    def update(self, percent: float, description: str) -> None:
        from prefect.artifacts import update_progress_artifact

        self._context.run(update_progress_artifact, self._id, percent, description, _sync=True)


# ---- the child-process protocol ------------------------------------------------------------------------


def child_line(label: str, done: float, total: float, unit: str, file: TextIO | None = None) -> None:
    """In a child process: say how far `label` is, as one machine-readable line on stderr."""
    payload = json.dumps({"label": label, "done": done, "total": total, "unit": unit})
    print(PREFIX + payload, file=file if file is not None else sys.stderr, flush=True)


def parse_child_line(line: str) -> dict | None:
    """The fields of a `child_line`, or None when `line` is not a well-formed one."""
    if not line.startswith(PREFIX):
        return None
    try:
        data = json.loads(line[len(PREFIX):])
        fields = {"label": str(data["label"]), "done": float(data["done"]), "total": float(data["total"]),
                  "unit": str(data.get("unit") or "")}
    except (ValueError, KeyError, TypeError):
        return None
    return fields if math.isfinite(fields["done"]) and math.isfinite(fields["total"]) else None


class ChildProgress:
    """A parent's view of its child's progress lines: one `Progress` at a time, closed when it reaches its
    total or when the label changes (calibration pass 1, pass 2, …)."""

    def __init__(self, log: Callable[[str], None], **options: Any) -> None:
        self._log, self._options = log, options
        self._current: Progress | None = None

    def feed(self, line: str) -> bool:
        """Take `line` if it is a progress line (True); other lines are the caller's to log."""
        fields = parse_child_line(line)
        if fields is None:
            return False
        current = self._current
        if current is None or current.label != fields["label"]:
            if current is not None:
                current.close()
            current = self._current = Progress(fields["label"], fields["total"], fields["unit"], self._log,
                                               **self._options)
        current.update(fields["done"])
        if fields["done"] >= fields["total"]:  # said now, not when the child's next line comes
            current.close()
            self._current = None
        return True

    def log(self, line: str) -> None:
        """Log a child's line around the bar, if one is drawn."""
        current = self._current
        (current.printer(self._log) if current is not None else self._log)(line)

    def close(self, ok: bool = True) -> None:
        if self._current is not None:
            self._current.close(ok)
