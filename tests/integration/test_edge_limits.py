"""Bounds at the stable endpoint (issue 51), on the real HAProxy in front of the real Triton: an oversized body, a
body or headers trickled a byte a second, oversized headers, a connection flood and a request flood from one
client, each refused at the proxy in its route's shape while another client's requests still answer, and one
gRPC channel carrying more streams than the per-client connection bound.

Each attack comes from its own loopback address (127.0.0.N: all of 127/8 is this host), so the proxy counts it
apart from the others; the well-behaved client is 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import pytest

from stoker.serving import edge

from promotion_kit import deploy, generate, serving_tag
from promotion_kit import build, client, images, s3, target  # noqa: F401 -- fixtures the tests request

pytestmark = [pytest.mark.docker, pytest.mark.s3]

LIMITS = edge.EdgeLimits(max_body_bytes=64 << 10, request_timeout_s=3, max_connections_per_client=8,
                         max_requests_per_client_per_s=4)
GENERATE = "/v2/models/ensemble/generate"


def _connect(port: int, source: str, timeout_s: float = 10) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0))
    s.settimeout(timeout_s)
    return s


def _answer(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response on ``s``: (status, headers, body); status 0 when the proxy closed without one."""
    raw = b""
    try:
        while b"\r\n\r\n" not in raw:
            chunk = s.recv(65536)
            if not chunk:
                return 0, {}, raw
            raw += chunk
    except (ConnectionResetError, BrokenPipeError):
        return 0, {}, raw
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:]))
    n = int(headers.get("content-length", "0"))
    while len(body) < n:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _request(port: int, source: str, data: bytes, trickle: bytes = b"") -> tuple[int, dict, bytes, float]:
    """Send ``data`` at once, then ``trickle`` a byte a second until the proxy answers or closes."""
    t0 = time.monotonic()
    with _connect(port, source) as s:
        s.sendall(data)
        for byte in trickle:
            s.settimeout(1.0)
            try:
                got = s.recv(65536, socket.MSG_PEEK)
                if got or got == b"":
                    break
            except TimeoutError:
                pass
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
        s.settimeout(10)
        status, headers, body = _answer(s)
    return status, headers, body, time.monotonic() - t0


def _kserve_error(body: bytes) -> str:
    err = json.loads(body)["error"]
    assert isinstance(err, str), body
    return err


def test_each_bound_is_held_at_the_proxy_in_its_routes_shape_while_another_client_answers(client, target, build):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    bounded = dataclasses.replace(target, limits=LIMITS)
    deploy(client, bounded, build("a"))
    port = bounded.listen.http
    assert serving_tag(bounded) == "a"  # generate_stream streams through the buffered backend

    # An oversized body: 413 on its Content-Length, before the body is read; a chunked one once buffered.
    big = b'{"text_input": "' + b"x" * (LIMITS.max_body_bytes + 10) + b'", "max_tokens": 3}'
    status, headers, body, _ = _request(port, "127.0.0.2", b"POST %s HTTP/1.1\r\nhost: a\r\ncontent-type: "
                                        b"application/json\r\ncontent-length: %d\r\n\r\n" % (GENERATE.encode(),
                                                                                              len(big)))
    assert status == 413 and headers["content-type"] == "application/json", (status, body)
    assert _kserve_error(body).startswith(f"the request body is over {LIMITS.max_body_bytes} bytes"), body
    chunked = b"POST %s HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        GENERATE.encode(), len(big), big)
    status, _, body, _ = _request(port, "127.0.0.2", chunked)
    assert status == 413 and "request body is over" in _kserve_error(body), (status, body)

    # A body trickled a byte a second: 408 from the proxy once the request timeout passes, in KServe's shape;
    # the backend never held it, and another client's generation answers meanwhile.
    small = b'{"text_input": "hi", "max_tokens": 3}'
    head = b"POST %s HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
        GENERATE.encode(), len(small))
    status, headers, body, took = _request(port, "127.0.0.3", head, trickle=small)
    assert status == 408 and "did not arrive within 3 s" in _kserve_error(body), (status, body)
    assert LIMITS.request_timeout_s - 0.5 < took < LIMITS.request_timeout_s + 4, took
    assert generate(bounded.endpoint["http"]).startswith("a")
    # Headers trickled: 408 too (HAProxy's own page: no route is known before the headers end).
    status, _, body, took = _request(port, "127.0.0.3", b"GET /v2/health/ready HTTP/1.1\r\n",
                                     trickle=b"host: " + b"a" * 30 + b"\r\n\r\n")
    assert status == 408 and took < LIMITS.request_timeout_s + 4, (status, body[:200], took)

    # Oversized headers, or too many of them: 400 from HAProxy's parser.
    over = b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\nx-pad: " + b"a" * (edge.HEADER_BYTES + 1) + b"\r\n\r\n"
    assert _request(port, "127.0.0.2", over)[0] == 400
    many = b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\n" + b"".join(
        b"x-%d: 1\r\n" % i for i in range(edge.MAX_HEADERS + 5)) + b"\r\n"
    assert _request(port, "127.0.0.2", many)[0] == 400
    assert _request(port, "127.0.0.2", b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\nx-pad: " + b"a" * 8000
                    + b"\r\n\r\n")[0] == 200  # under the bound: served

    # A connection flood from one address: the first max_connections_per_client serve, the rest are closed as
    # they are accepted; another client's generation answers meanwhile, and the flooder's own connections serve.
    held: list[socket.socket | None] = []
    for _ in range(3 * LIMITS.max_connections_per_client):
        try:
            held.append(_connect(port, "127.0.0.4"))
        except ConnectionResetError:
            # The proxy accepted and reset it before connect() returned to us (a busy host): closed as accepted.
            held.append(None)
    try:
        time.sleep(0.3)
        answered = []
        for s in held:
            if s is None:
                answered.append(0)
                continue
            try:
                s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\n\r\n")
            except OSError:
                answered.append(0)
                continue
            answered.append(_answer(s)[0])
        assert answered.count(200) == LIMITS.max_connections_per_client, answered
        assert answered.count(0) == 2 * LIMITS.max_connections_per_client, answered
        assert generate(bounded.endpoint["http"]).startswith("a")
    finally:
        for s in held:
            if s is not None:
                s.close()

    # A request flood from one address on one keep-alive connection: past the rate, 429 with Retry-After in
    # KServe's shape; another address is not slowed.
    codes, refused = [], None
    with _connect(port, "127.0.0.5") as s:
        for _ in range(LIMITS.max_requests_per_client_per_s * edge.RATE_WINDOW_S + 20):
            s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\n\r\n")
            status, headers, body = _answer(s)
            codes.append(status)
            if status == 429:
                refused = headers, body
    # HAProxy's rate is a sliding estimate over fixed periods (the previous period's count weighted by what is left
    # of it): a flood that straddles a period boundary is counted a little low, so a few more may pass.
    bound = LIMITS.max_requests_per_client_per_s * edge.RATE_WINDOW_S
    assert bound <= codes.count(200) <= bound + 6 and codes.count(200) + codes.count(429) == len(codes), codes
    assert codes[:bound] == [200] * bound and refused is not None, codes
    assert refused[0]["retry-after"] == str(edge.RETRY_AFTER_S)
    assert _kserve_error(refused[1]).startswith(f"over {LIMITS.max_requests_per_client_per_s} requests a second")
    assert generate(bounded.endpoint["http"]).startswith("a")

    # gRPC: one channel (one HTTP/2 connection) carries more concurrent streams than the per-client connection
    # bound, all answered; then that client's call rate is bounded with RESOURCE_EXHAUSTED.
    import asyncio

    import tritonclient.grpc.aio as aio

    from stream_clients import grpc_inputs

    async def streams(n: int) -> list[int]:
        c = aio.InferenceServerClient(bounded.endpoint["grpc"])

        async def one() -> int:
            async def requests():
                model, inputs = grpc_inputs(aio, 3)
                yield {"model_name": model, "inputs": inputs}

            got = 0
            async for result, error in c.stream_infer(requests()):
                assert error is None, error
                got += 1
                if got == 3:
                    break
            return got

        try:
            return await asyncio.gather(*(one() for _ in range(n)))
        finally:
            await c.close()

    assert asyncio.run(streams(2 * LIMITS.max_connections_per_client)) == [3] * 2 * LIMITS.max_connections_per_client
    g = grpcclient.InferenceServerClient(bounded.endpoint["grpc"])
    outcomes = []
    for _ in range(LIMITS.max_requests_per_client_per_s * edge.RATE_WINDOW_S + 10):
        try:
            outcomes.append(g.is_server_live())
        except InferenceServerException as exc:
            outcomes.append(exc.status())
    g.close()
    assert "StatusCode.RESOURCE_EXHAUSTED" in outcomes and True in outcomes, outcomes
