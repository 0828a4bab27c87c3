"""Bounds at the stable endpoint (issue 51): what one client, and all of them, may ask of the proxy before the live
backend sees a byte. Pure rendering of HAProxy lines; stoker.serving.haproxy places them in its sections.

Each bound, what HAProxy does when it is crossed, and the answer's shape (tests/integration/test_edge_limits.py):

- request body over ``max_body_bytes``: 413, refused on its Content-Length before a byte of the body is read, or on
  what the buffered body turns out to be (a chunked one); KServe's ``{"error": "..."}`` on Triton's routes,
  OpenAI's error object on /v1/. A chunked body is counted as far as the proxy's buffer holds it (HAProxy's
  ``req.body_size``); past that the service's own bound applies (the OpenAI service's 4 MiB, Triton's input size).
- a request whose headers, or whose body, do not arrive within ``request_timeout_s`` (a client trickling a byte a
  second): 408. The body waits in the proxy (``option http-buffer-request`` on the HTTP backends: the request is
  sent on only once its body is whole or fills the buffer) under HAProxy's ``timeout http-request``, so the backend
  never holds a trickled request. A body's 408 is in its route's shape; a request whose headers never complete has
  no route yet and gets HAProxy's own 408 page (HTML: the HTTP/1 layer answers it from built-in messages, 2.6's
  mux_h1 ``h1_send_error``).
- headers over HEADER_BYTES in all, or more than MAX_HEADERS lines: 400, HAProxy's own page (its HTTP/1 parser
  refuses a request head that does not fit its buffer; it has no 431).
- more than ``max_connections_per_client`` connections open from one client address (HTTP, gRPC and metrics ports
  together): the next connection is closed as it is accepted, before a byte is read (a flood costs a socket for a
  moment, never a request to the backend). gRPC multiplexes a channel's calls over one HTTP/2 connection, so one
  client's long-lived channel counts once however many streams it carries.
- more than ``max_requests_per_client_per_s`` requests a second from one address, averaged over RATE_WINDOW_S
  (0: no bound): 429 with ``Retry-After``, in the route's shape; on the gRPC port RESOURCE_EXHAUSTED.
- ``max_connections`` connections in all (every port): HAProxy stops accepting; the next ones wait in the kernel's
  queue until one closes (no refusal).

Health (/v2/health/*) is bound like any route: the proxy's own checks go to the backends directly, not through
these frontends. A connection over a unix socket (the OpenAI service's way to the gRPC frontend) has no client
address and is not counted: its clients were counted at the HTTP port.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

TABLE = "edge_clients"  # the stick table of client addresses (a backend section of its own, HAProxy's way)
RATE_WINDOW_S = 10
# The proxy's buffer and header count, pinned (HAProxy's defaults): a request head must fit in tune.bufsize less
# tune.maxrewrite, so HEADER_BYTES is the most a client's request line and headers may weigh.
BUFSIZE, MAXREWRITE, MAX_HEADERS = 16384, 1024, 101
HEADER_BYTES = BUFSIZE - MAXREWRITE
RETRY_AFTER_S = 1  # a client over its rate retries after this long (the window slides; a second frees a tenth)


@dataclass(frozen=True)
class EdgeLimits:
    """deploy.limits as the proxy reads them (stoker.spec.schema.Limits holds the same defaults)."""

    max_body_bytes: int = 16 << 20
    request_timeout_s: int = 30
    max_connections: int = 4096
    max_connections_per_client: int = 1024
    max_requests_per_client_per_s: int = 0  # 0: no bound

    def changed(self) -> dict:
        """The fields set away from their defaults (what the proxy's label carries). Pure."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def kserve(message: str) -> str:
    return '{"error": "%s"}' % message


def openai(message: str, type_: str, code: str) -> str:
    return ('{"error": {"message": "%s", "type": "%s", "param": null, "code": "%s"}}' % (message, type_, code))


def too_large(limits: EdgeLimits) -> str:
    return f"the request body is over {limits.max_body_bytes} bytes, the most this endpoint accepts"


def too_slow(limits: EdgeLimits) -> str:
    return f"the request did not arrive within {limits.request_timeout_s} s (the endpoint's request timeout)"


def too_fast(limits: EdgeLimits) -> str:
    return (f"over {limits.max_requests_per_client_per_s} requests a second from this client (averaged over "
            f"{RATE_WINDOW_S} s); retry after {RETRY_AFTER_S} s")


def global_lines() -> list[str]:
    """The `global` section's buffer and header bounds."""
    return [f"    tune.bufsize {BUFSIZE}", f"    tune.maxrewrite {MAXREWRITE}", f"    tune.http.maxhdr {MAX_HEADERS}"]


def defaults_lines(limits: EdgeLimits) -> list[str]:
    return [f"    timeout http-request {limits.request_timeout_s}s"]


def table_lines(limits: EdgeLimits) -> list[str]:
    """The table of client addresses every frontend tracks (connections open now, request rate)."""
    return [f"backend {TABLE}",
            f"    stick-table type ipv6 size 100k expire {max(60, 2 * RATE_WINDOW_S)}s "
            f"store conn_cur,http_req_rate({RATE_WINDOW_S}s)", ""]


def frontend_lines(section: str, limits: EdgeLimits, names_v1: bool) -> list[str]:
    """A frontend's bounds, before its keys and routes: connections per client and in all, request rate, body size.
    ``names_v1``: the frontend's `openai` acl exists (/v1/ answers in OpenAI's shape)."""
    rate = limits.max_requests_per_client_per_s
    lines = [f"    maxconn {limits.max_connections}",
             f"    tcp-request connection track-sc0 src table {TABLE}",
             f"    tcp-request connection reject if {{ sc0_conn_cur gt {limits.max_connections_per_client} }}"]
    over_rate = f"{{ sc0_http_req_rate gt {rate * RATE_WINDOW_S} }}"
    if section == "grpc":
        if rate:  # RESOURCE_EXHAUSTED (8), trailers-only, as the proxy's other gRPC refusals
            lines.append(f"    http-request return status 200 hdr grpc-status 8 "
                         f"hdr grpc-message {_q(too_fast(limits).replace(' ', '%%20'))} if {over_rate}")
        return lines  # a gRPC call's body is a stream: its message size is the backend's bound
    over_body = f"{{ req.hdr_val(content-length) gt {limits.max_body_bytes} }}"
    shapes = [("openai", True), ("", False)] if names_v1 else [("", False)]
    for cond, is_openai in shapes:
        only = "openai " if cond else ""
        if rate:
            body = (openai(too_fast(limits), "rate_limit_error", "rate_limit_exceeded") if is_openai
                    else kserve(too_fast(limits)))
            lines.append(f"    http-request return status 429 content-type application/json hdr retry-after "
                         f"{RETRY_AFTER_S} string {_q(body)} if {only}{over_rate}")
        body = (openai(too_large(limits), "invalid_request_error", "request_too_large") if is_openai
                else kserve(too_large(limits)))
        lines.append(f"    http-request return status 413 content-type application/json string {_q(body)} "
                     f"if {only}{over_body}")
    return lines


def backend_lines(limits: EdgeLimits, openai_shape: bool) -> list[str]:
    """An HTTP backend's bounds: the body waits whole in the proxy (or until it fills the buffer) under the request
    timeout, then its size is checked; the 408 and 413 answers in the route's shape."""
    if openai_shape:
        slow = openai(too_slow(limits), "invalid_request_error", "request_timeout")
        large = openai(too_large(limits), "invalid_request_error", "request_too_large")
    else:
        slow, large = kserve(too_slow(limits)), kserve(too_large(limits))
    return ["    option http-buffer-request",
            f"    http-error status 408 content-type application/json string {_q(slow)}",
            f"    http-request return status 413 content-type application/json string {_q(large)} "
            f"if {{ req.body_size gt {limits.max_body_bytes} }}"]
