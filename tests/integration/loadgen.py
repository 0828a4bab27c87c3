"""Steady load against a Triton endpoint while something changes underneath (a rollout): every request counted.

Each worker thread loops: one streamed generation (HTTP SSE ``generate_stream``) to
whatever ``endpoint()`` returns at that moment; a request fails on a connection error,
a non-200 answer, an error event or no output. Raw records first, counts derived.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass(frozen=True)
class Record:
    start_s: float
    end_s: float
    ok: bool
    error: str | None


@dataclass
class SteadyLoad:
    endpoint: Callable[[], str]  # current http://host:port
    threads: int = 2
    max_tokens: int = 4
    timeout_s: float = 60.0
    records: list[Record] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _one(self) -> Record:
        t0 = time.monotonic()
        url = urlparse(self.endpoint())
        body = json.dumps({"text_input": "steady load", "max_tokens": self.max_tokens, "stream": True})
        try:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.timeout_s)
            try:
                conn.request("POST", "/v2/models/ensemble/generate_stream", body=body,
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                text = resp.read().decode("utf-8", "replace")
            finally:
                conn.close()
            events = [json.loads(ln[5:]) for ln in text.splitlines() if ln.startswith("data:")]
            err = next((e["error"] for e in events if "error" in e), None)
            if resp.status != 200:
                return Record(t0, time.monotonic(), False, f"HTTP {resp.status}: {text[:120]}")
            if err or not events:
                return Record(t0, time.monotonic(), False, err or "no output")
            return Record(t0, time.monotonic(), True, None)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return Record(t0, time.monotonic(), False, f"{type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            rec = self._one()
            with self._lock:
                self.records.append(rec)
            if not rec.ok:
                time.sleep(0.05)  # a refused port fails in microseconds: do not spin

    def start(self) -> SteadyLoad:
        for i in range(self.threads):
            t = threading.Thread(target=self._loop, name=f"load-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def stop(self) -> dict:
        self._stop.set()
        for t in self._workers:
            t.join(timeout=self.timeout_s + 5)
        return self.summary()

    def summary(self) -> dict:
        with self._lock:
            recs = list(self.records)
        failed = [r for r in recs if not r.ok]
        # The slowest answer: tells a machine too loaded to answer quickly (many slow answers) from one request held
        # up by the rollout itself.
        slowest = max((r.end_s - r.start_s for r in recs if r.ok), default=0.0)
        return {"requests": len(recs), "failed_requests": len(failed), "slowest_answer_s": round(slowest, 2),
                "errors": sorted({(r.error or "")[:100] for r in failed})[:5]}
