"""The webhook receiver (stoker/webhook) fuzzed from its own trigger model.

Bodies are ``webhook.app.Trigger`` objects whose every field is valid, at a boundary or any JSON value (spec names
inside and outside SPEC_NAME, revisions with spaces or 201 characters, timestamps now, outside the window, huge,
fractional or not numbers, idempotency keys), plus unknown fields, JSON that is not an object, nested deep, not
UTF-8, over the size limit. Each is sent signed with the right secret (so the checks after the signature run), with
a wrong one, a malformed or non-ASCII signature header, or none; with wrong methods and paths too.

Invariants (``check``): no 5xx but the documented 503 (the deployment's pool has no worker, or Prefect cannot start
the run), every error in the receiver's own shape ``{"error": "<one line>"}``, a 202 only for a signed body, 401
for every unsigned or badly signed one (or 429/413, checked before the signature), and /healthz answered
throughout by another client.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
from hypothesis import strategies as st

from stoker.webhook.signing import SIGNATURE_HEADER, sign

from . import Tally, Target
from ._drive import Canary, drive
from .openai import ANY, BIG_INTS

SURFACE = "webhook"
TIMEOUT_S = 30.0
DOCUMENTED_5XX = {503}
# Statuses the receiver documents (docs/triggers.md), and 404/405 for anything but its routes and methods.
DOCUMENTED = {202, 400, 401, 404, 405, 409, 413, 429, 503}


@dataclass
class Case:
    method: str
    path: str
    body: bytes
    headers: dict[str, bytes] = field(default_factory=dict)
    signed: bool = False  # carries the right signature of its body

    def describe(self) -> str:
        shown = {k: v[:80].decode("latin-1") for k, v in self.headers.items()}
        return f"{self.method} {self.path} {shown} {self.body[:300].decode('utf-8', 'replace')}"


SPEC = st.one_of(st.sampled_from(["tiny", "example-full", "llama3-8b-int4awq-l4"]),
                 st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True),
                 st.sampled_from(["", "../etc/passwd", "a/b", ".hidden", "x" * 300, "tiny.yaml", "TINY", "t\u00efny"]),
                 ANY)
REVISION = st.one_of(st.sampled_from(["main", "v1.0", "0" * 40]), st.text(max_size=12),
                     st.sampled_from(["", "a b", "x" * 201, "main\n"]), ANY)


def _timestamp(now: float) -> st.SearchStrategy:
    return st.one_of(st.just(int(now)), st.integers(int(now) - 400, int(now) + 400), BIG_INTS,
                     st.sampled_from([now, str(int(now)), None, True, float("inf"), float("nan"), 1e300]), ANY)


@st.composite
def triggers(draw, now: float) -> bytes:
    """A trigger's bytes, as a CI job would post it or worse."""
    shape = draw(st.sampled_from(["trigger"] * 8 + ["json", "raw"]))
    if shape == "json":
        return json.dumps(draw(ANY)).encode()
    if shape == "raw":
        return draw(st.one_of(st.binary(max_size=100), st.sampled_from([
            b"", b"{", b"[" * 30_000 + b"]" * 30_000, b'{"a":' * 10_000, b'{"spec": "\xff"}', b'{"spec": "\\ud800"}',
            b'{"timestamp": 1e999999}', b'{"timestamp": ' + b"9" * 5000 + b"}", b"\xef\xbb\xbf{}",
            b'{"spec": "tiny", "pad": "' + b"x" * 70_000 + b'"}'])))
    fields = {"spec": SPEC, "repo": st.none() | st.text(max_size=20) | ANY, "revision": REVISION,
              "timestamp": _timestamp(now), "idempotency_key": st.none() | st.text(max_size=12) | st.just("k" * 201)}
    body = {}
    for name, values in fields.items():
        if draw(st.integers(0, 9)) > 0:  # a field left out now and then
            body[name] = draw(values)
    body.update(draw(st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), ANY, max_size=1)))
    return json.dumps(body, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")


@st.composite
def cases(draw, target: Target, now: float) -> Case:
    """``now``: fixed for a run (hypothesis wants the same draws to give the same case)."""
    secret = (target.webhook_secret or "").encode()
    body = draw(triggers(now))
    how = draw(st.sampled_from(["right"] * 6 + ["wrong", "none", "malformed", "latin1", "twice", "upper"]))
    good = sign(secret, body).encode()
    header = {"right": good, "wrong": sign(b"not-the-secret", body).encode(), "none": b"",
              "malformed": draw(st.sampled_from([b"sha256=", b"sha256=zz", b"sha1=" + good[7:], good[7:], b"sha256",
                                                 good + b"00", good + b"\t1", b"sha256=" + good])),
              "latin1": b"sha256=" + "\u00e9".encode("latin-1") * 64, "twice": good + b", " + good,
              "upper": b"sha256=" + good[7:].upper()}[how]
    headers = {"content-type": draw(st.sampled_from([b"application/json", b"text/plain", b""]))}
    if header:
        headers[SIGNATURE_HEADER.lower()] = header
    method, path = "POST", "/hooks/build"
    if draw(st.integers(0, 9)) == 0:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "POST", "PATCH"]))
        path = draw(st.sampled_from(["/hooks/build", "/hooks/build/", "/hooks", "/healthz", "/", "/%ff"]))
    return Case(method, path, body, headers, signed=how == "right")


def _error_shape(body: object) -> str | None:
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str) and body["error"]):
        return "not {'error': '<message>'}"
    if "\n" in body["error"]:
        return "a message of more than one line"
    return None


class Checker:
    def __init__(self, client: httpx.Client, tally: Tally, secret: str) -> None:
        self.client, self.tally, self.secret = client, tally, secret

    def __call__(self, case: Case) -> None:
        try:
            r = self.client.request(case.method, case.path, content=case.body, headers=case.headers)
        except httpx.HTTPError as err:
            self.tally.saw("no-answer")
            self.tally.broke(f"{case.method} {case.path}: connection failed: {type(err).__name__}",
                             f"{err} <- {case.describe()}")
            return
        self.tally.saw(r.status_code)
        if problem := self._problem(case, r):
            where = case.path if case.path in ("/hooks/build", "/healthz") else "<other path>"
            self.tally.broke(f"{case.method} {where}: {problem}", f"{r.text[:300]} <- {case.describe()}")

    def _problem(self, case: Case, r: httpx.Response) -> str | None:
        status = r.status_code
        if self.secret in r.text:
            return "the secret in an answer"
        if case.path == "/healthz" and case.method == "GET":
            return None if status == 200 else f"/healthz answered {status}"
        if status == 307 and case.path.endswith("/") and r.headers.get("location", "").endswith(case.path[:-1]):
            return None  # Starlette's redirect to the route without the trailing slash
        if status not in DOCUMENTED:
            return f"an undocumented status {status}"
        try:
            body = r.json()
        except ValueError:
            return f"{status} with a body that is not JSON"
        if status == 202:
            if not case.signed:
                return "202 for a body that is not signed right"
            return None if isinstance(body, dict) and body.get("flow_run_id") else "202 without flow_run_id"
        if shape := _error_shape(body):
            return f"{status} error in the wrong shape ({shape})"
        if case.method == "POST" and case.path == "/hooks/build" and not case.signed and status not in (401, 413, 429):
            return f"{status} for a body that is not signed right (401 expected)"
        return None


def healthy(client: httpx.Client) -> str | None:
    r = client.get("/healthz")
    return None if r.status_code == 200 and r.json() == {"ok": True} else f"{r.status_code}: {r.text[:200]}"


def run(target: Target, max_examples: int, seed: int) -> Tally:
    """Fuzz the receiver at ``target.webhook`` (its /hooks/build URL) with ``max_examples`` generated requests."""
    if not target.webhook or not target.webhook_secret:
        raise ValueError("the webhook surface needs target.webhook and target.webhook_secret")
    base = target.webhook.removesuffix("/hooks/build")
    tally = Tally(SURFACE)
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as client, \
            httpx.Client(base_url=base, timeout=TIMEOUT_S) as other:
        with Canary(tally, lambda: healthy(other)):
            drive(cases(target, time.time()), Checker(client, tally, target.webhook_secret), max_examples, seed)
        if problem := healthy(other):
            tally.broke("after the run: /healthz failed", problem)
    return tally
