"""Asking a Triton backend whether it serves: readiness, a settle window, a smoke inference, error counts.

"Ready" is proven, not assumed: one 200 from ``/v2/health/ready`` has been followed by the
server exiting (its metrics port was taken), so a candidate must stay ready through a settle
window and then stream a real generation through ``ensemble`` before it may take traffic.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from ..errors import StokerError
from ..protocol import ENSEMBLE, Interface
from ..triton.config import ENSEMBLE_NAME
from ..triton.metrics import in_flight
from ..triton.metrics import parse as parse_metrics
from . import traffic


class ProbeFailed(StokerError):
    """A backend did not become ready, did not stay ready, or did not answer a generation sanely."""


def http_status(url: str, timeout_s: float) -> int:
    """GET ``url``; the HTTP status, or OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def admin_closed(http_url: str, header: dict[str, str], timeout_s: float = 5.0) -> None:
    """Raise ProbeFailed when ``header`` (the token's public placeholder) opens the backend's admin API: then the
    argv_secret shim did not load in the image (the dynamic loader only warns about a missing LD_PRELOAD) and
    tritonserver took the placeholder itself as its key, which anyone can send."""
    req = urllib.request.Request(f"{http_url}/v2/repository/index", data=b"{}", headers=header, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            status = response.status
    except urllib.error.HTTPError as err:
        status = err.code
    if status == 200:
        raise ProbeFailed("its admin API opens with the public placeholder of its token: the argv_secret shim did "
                          "not load in its image (LD_PRELOAD), so the backend is refused")


def is_ready(http_url: str, timeout_s: float = 2.0, attempts: int = 1) -> bool:
    """One 200 from /v2/health/ready within ``attempts`` tries (a saturated server can be slow to answer)."""
    for i in range(attempts):
        try:
            if http_status(f"{http_url}/v2/health/ready", timeout_s) == 200:
                return True
        except OSError:
            pass
        if i + 1 < attempts:
            time.sleep(0.2)
    return False


class Readiness:
    """Readiness judged as a production probe does (Kubernetes' failureThreshold × periodSeconds): a backend is
    unready only after ``failures`` probes in a row have failed over at least ``span_s`` seconds. One slow or
    missed answer on a busy host is not a verdict; a backend that stays unready is. Pure: the caller probes and
    passes the clock reading.
    """

    def __init__(self, failures: int = 3, span_s: float = 15.0):
        self.failures, self.span_s = failures, span_s
        self.streak = 0
        self.since: float | None = None

    def observe(self, ok: bool, now: float) -> bool:
        """Record one probe; True once the backend counts as unready."""
        if ok:
            self.streak, self.since = 0, None
            return False
        self.streak += 1
        self.since = now if self.since is None else self.since
        return self.streak >= self.failures and now - self.since >= self.span_s

    @property
    def failing(self) -> bool:
        """A streak of failed probes is open: not yet a verdict either way."""
        return self.streak > 0

    def describe(self, now: float) -> str:
        span = now - self.since if self.since is not None else 0.0
        return f"{self.streak} probes in a row over {span:.1f} s"


def wait_ready(
    url: str,
    timeout_s: float,
    *,
    request: Callable[[str, float], int] = http_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    exit_reason: Callable[[], str | None] = lambda: None,
    interval_s: float = 0.5,
) -> float:
    """Poll ``url`` until it answers 200; returns the seconds waited.

    Raises ProbeFailed at the deadline, or at once when ``exit_reason()`` reports the server gone.
    """
    start = clock()
    deadline = start + timeout_s
    last = "no answer"
    while True:
        reason = exit_reason()
        if reason:
            raise ProbeFailed(f"container exited before it was ready ({reason})")
        try:
            status = request(url, max(0.1, min(2.0, deadline - clock())))
            if status == 200:
                return clock() - start
            last = f"HTTP {status}"
        except OSError as err:  # refused, reset, timeout: the server is still starting
            last = str(err) or type(err).__name__
        if clock() >= deadline:
            raise ProbeFailed(f"not ready after {timeout_s:g} s (last answer: {last})")
        sleep(interval_s)


def hold_ready(
    url: str,
    window_s: float,
    *,
    request: Callable[[str, float], int] = http_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    exit_reason: Callable[[], str | None] = lambda: None,
    interval_s: float = 0.25,
) -> None:
    """The settle window: ``url`` answers 200 at every poll for ``window_s`` and the process stays up."""
    deadline = clock() + window_s
    while True:
        reason = exit_reason()
        if reason:
            raise ProbeFailed(f"was ready, then exited during the settle window ({reason})")
        try:
            status = request(url, 2.0)
        except OSError as err:
            raise ProbeFailed(f"was ready, then stopped answering during the settle window ({err})") from None
        if status != 200:
            raise ProbeFailed(f"was ready, then answered HTTP {status} during the settle window")
        if clock() >= deadline:
            return
        sleep(interval_s)


def smoke(http_url: str, interface: Interface = ENSEMBLE, prompt: str = "Hello", max_tokens: int = 4,
          timeout_s: float = 60.0) -> dict:
    """Stream one generation through the model ``interface`` addresses (the ensemble, or the LLM API's model):
    tokens must arrive and the stream must end cleanly."""
    body = json.dumps(interface.request(prompt, max_tokens, streaming=True)).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/{interface.model}/generate_stream", data=body,
                                 method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            raw = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        raise ProbeFailed(f"smoke inference: the model answered an error (HTTP {err.code}): "
                          f"{_error_text(err.read())}") from None
    except OSError as err:
        raise ProbeFailed(f"smoke inference: no complete answer from {http_url} ({err})") from None
    events = [json.loads(ln[5:]) for ln in raw.splitlines() if ln.startswith("data:")]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        raise ProbeFailed(f"smoke inference: the model answered an error: {str(errors[0]).splitlines()[0]}")
    if not events or not any(interface.text_output in e for e in events):
        raise ProbeFailed("smoke inference: the stream ended without any token")
    # The text as the interface streams it: the LLM API's model sends the whole output so far in every event, so
    # joining the events would repeat it; the answer is its last output. A revision of text already streamed is
    # counted, not hidden.
    answer = interface.answer()
    for e in events:
        answer.add(interface.text_of(e))
    answer.end()
    return {"events": len(events), "text": answer.text.decode("utf-8", "replace"),
            "revisions": len(answer.revisions), "seconds": round(time.perf_counter() - t0, 3)}


def _error_text(raw: bytes) -> str:
    """Triton's error, whether the body is JSON or an SSE event ``data: {"error": ...}``."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        return str(json.loads(text.removeprefix("data:").strip()).get("error", "")).splitlines()[0]
    except (ValueError, AttributeError, IndexError):
        return text[:200]


def request_counts(metrics_url: str, model: str = ENSEMBLE_NAME, timeout_s: float = 2.0) -> tuple[float, float]:
    """(successes, failures) of ``model`` since the server started, from Triton's Prometheus metrics."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        row = parse_metrics(resp.read().decode("utf-8", "replace")).get(model, {})
    return row.get("success", 0.0), row.get("failure", 0.0)


def route_tallies(metrics_url: str, timeout_s: float = 2.0) -> dict[str, traffic.Tally]:
    """Every model's requests since the server started, failures split by whose fault (serving.traffic)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        return traffic.triton_tallies(resp.read().decode("utf-8", "replace"))


def requests_in_flight(metrics_url: str, timeout_s: float = 2.0) -> int | None:
    """Requests a backend has begun or queued and not answered (triton_metrics.in_flight); None: it cannot tell."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        return in_flight(resp.read().decode("utf-8", "replace"))
