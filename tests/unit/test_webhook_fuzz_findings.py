"""What the fuzzer of the webhook receiver found (benchmarks/fuzz_surfaces/webhook.py, issue 51), one test each:
every answer in the receiver's own shape ``{"error": "<one line>"}``, none a 500."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from starlette.testclient import TestClient

from stoker.webhook import signing
from stoker.webhook.app import ReceiverConfig, Started, create_app

SECRET = b"k"


async def _start(_deployment, _params, key, identity):
    return Started("run-1", "name", True, identity)


async def _ok(_spec, _deployment):
    return None


@pytest.fixture
def client(tmp_path):
    (tmp_path / "tiny.yaml").write_text("model: {repo_id: o/m}\nstorage: {bucket: b-b-b}\n")
    cfg = ReceiverConfig(secret=SECRET, specs_dir=tmp_path, max_body_bytes=64 * 1024, window_s=60, rate_per_s=1000,
                         burst=1000)
    return TestClient(create_app(cfg, start_run=_start, check_run=_ok, clock=lambda: 1000.0),
                      raise_server_exceptions=False)


def _signed(body: bytes) -> dict:
    return {"content": body, "headers": {signing.SIGNATURE_HEADER: signing.sign(SECRET, body)}}


def _error(r, status: int) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and "\n" not in body["error"], body
    return body["error"]


def test_a_signature_header_that_is_not_ascii_is_a_bad_signature(client):
    # hmac.compare_digest refuses str with non-ASCII characters (TypeError): a 500 before the fix.
    r = client.post("/hooks/build", content=b"{}", headers={signing.SIGNATURE_HEADER: ("sha256=" + "\u00e9" * 64).encode("latin-1")})
    assert "signature" in _error(r, 401)
    assert not signing.verify(SECRET, b"{}", "sha256=\u00e9")


def test_a_signed_body_nested_too_deep_is_an_invalid_trigger(client):
    # json.loads raises RecursionError (not a ValueError) past the interpreter's stack: a 500 before the fix.
    assert "invalid trigger" in _error(client.post("/hooks/build", **_signed(b"[" * 30_000 + b"]" * 30_000)), 400)


@pytest.mark.parametrize("timestamp", [10**400, -(10**400), 2**63], ids=["1e400", "-1e400", "2**63"])
def test_a_signed_timestamp_out_of_range_is_an_invalid_trigger(client, timestamp):
    # abs(now - 10**400) overflows a float (OverflowError): a 500 before the fix.
    body = b'{"spec": "tiny", "revision": "main", "timestamp": %d}' % timestamp
    assert "timestamp" in _error(client.post("/hooks/build", **_signed(body)), 400)


def test_other_routes_and_methods_answer_in_the_receivers_shape(client):
    # Starlette's own 404/405 are plain text ("Not Found"): not the shape a CI client parses.
    assert "not found" in _error(client.get("/nowhere"), 404).lower()
    r = client.get("/hooks/build")
    assert "method" in _error(r, 405).lower() and r.headers["allow"] == "POST"
    assert client.get("/healthz").json() == {"ok": True}


def test_a_signature_compares_in_constant_time_still(client):
    body = b'{"spec": "tiny", "revision": "main", "timestamp": 1000}'
    good = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    assert client.post("/hooks/build", content=body, headers={signing.SIGNATURE_HEADER: good}).status_code == 202
