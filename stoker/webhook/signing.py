"""Pure signing and checking of webhook bodies (no I/O, injectable clock)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field

SIGNATURE_HEADER = "X-Hub-Signature-256"
PREFIX = "sha256="


def sign(secret: bytes, body: bytes) -> str:
    """The header value for ``body``: ``sha256=<hex HMAC-SHA256>``, as GitHub sends it."""
    return PREFIX + hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify(secret: bytes, body: bytes, header: str | None) -> bool:
    """Constant-time check of the header against the raw body."""
    # Not ASCII: no hex digest; and hmac.compare_digest raises TypeError on such a str (a 500, found by the fuzzer).
    if not header or not header.startswith(PREFIX) or not header.isascii():
        return False
    return hmac.compare_digest(sign(secret, body), header.strip())


def signed_body(payload: dict, secret: bytes, now: float | None = None) -> tuple[bytes, dict[str, str]]:
    """A CI client's side: add the timestamp, serialize once, sign those exact bytes."""
    body = json.dumps({**payload, "timestamp": int(now if now is not None else time.time())},
                      separators=(",", ":")).encode()
    return body, {SIGNATURE_HEADER: sign(secret, body), "Content-Type": "application/json"}


def within_window(timestamp: float, now: float, window_s: float) -> bool:
    """The signed timestamp is no older (and no further in the future) than window_s."""
    return abs(now - timestamp) <= window_s


@dataclass
class TokenBucket:
    """Rate limit: ``rate`` requests per second with bursts of ``burst``, per client key."""

    rate: float
    burst: int
    # Bounded: a server facing many addresses keeps at most this many (issue 49: the map only ever grew).
    max_keys: int = 10_000
    _state: dict[str, tuple[float, float]] = field(default_factory=dict)

    def allow(self, key: str, now: float) -> bool:
        if key not in self._state and len(self._state) >= self.max_keys:
            self._sweep(now)
        tokens, last = self._state.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self._state[key] = (tokens, now)
            return False
        self._state[key] = (tokens - 1.0, now)
        return True

    def _sweep(self, now: float) -> None:
        """Forget buckets that have refilled (the same as no entry); under a flood of addresses still limited, keep
        the most recently seen half: a forgotten client gets a fresh burst, never a wrong refusal."""
        refill_s = self.burst / self.rate if self.rate > 0 else float("inf")
        self._state = {k: v for k, v in self._state.items() if now - v[1] < refill_s}
        if len(self._state) >= self.max_keys:
            keep = sorted(self._state.items(), key=lambda kv: kv[1][1])[-(self.max_keys // 2):]
            self._state = dict(keep)


@dataclass
class SeenKeys:
    """Idempotency keys seen within a time to live: key → (what the caller recorded for it, expiry)."""

    ttl_s: float
    _seen: dict[str, tuple[object, float]] = field(default_factory=dict)

    def get(self, key: str, now: float) -> object | None:
        self._seen = {k: v for k, v in self._seen.items() if v[1] > now}
        hit = self._seen.get(key)
        return hit[0] if hit else None

    def put(self, key: str, value: object, now: float) -> None:
        self._seen[key] = (value, now + self.ttl_s)
