"""HAProxy as the stable endpoint: its configuration (pure rendering) and its runtime API.

One proxy per deployment owns the spec's ports and forwards each request to the live
backend: HTTP/1.1 (``generate_stream`` SSE, keep-alive) on the HTTP port, HTTP/2 cleartext
(gRPC, streaming) on the gRPC port, and the metrics port. Each backend section has one
server per slot (blue, green); exactly one is in state ``ready``. A switch is a few runtime
API commands on the running proxy (no reload, no restart): established client connections
stay open and their next request goes to the new backend, while requests already on the old
backend finish there (``drain``). The rendered file mirrors the runtime state so that a
restarted proxy container comes back routing to the same backend.

With an OpenAI service (``stoker.serving.openai_service``), requests whose path begins with
``/v1/`` on the HTTP port go to it, over a unix socket in the shared state folder; everything else
goes to Triton as before. That route never changes at a switch: the service follows the switch
itself, through the proxy's gRPC frontend (bound a second time on a unix socket in its folder).
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..containers.ports import Ports
from . import edge

SLOTS = ("blue", "green")
# deploy.replicas: a slot's replica r is server `<slot>` (r = 0, the name a single backend always had) or `<slot>_<r>`;
# a slot's replicas share its traffic by least connections.
# (section name, the Ports attribute it forwards, HAProxy bind/server options)
SECTIONS = (("http", "http", ""), ("grpc", "grpc", " proto h2"), ("metrics", "metrics", ""))
CONFIG_NAME = "haproxy.cfg"
SOCKET_NAME = "admin.sock"
MOUNT = "/stoker"  # where the state folder appears inside the proxy container
# An unused slot still needs an address for its server line; nothing listens on port 1.
PLACEHOLDER = Ports(1, 1, 1)
# Long: a generation may stream for minutes, and gRPC channels stay open between requests.
STREAM_TIMEOUT = "1h"
OPENAI_BACKEND = "openai"
OPENAI_PATH = "/v1/"
# What a client of the OpenAI API gets when the service does not answer: OpenAI's error shape.
OPENAI_DOWN = ('{"error": {"message": "the OpenAI API of this deployment is not running (HTTP %d from the proxy)", '
               '"type": "server_error", "param": null, "code": "backend_unavailable"}}')

# Only inference is public. Through the stable address a client may ask health, server and model metadata (and
# config), readiness and inference (infer, generate, generate_stream; gRPC ModelInfer/ModelStreamInfer), and
# /metrics on the metrics port. Model control, the repository index, statistics, logging, trace and shared memory
# answer 403 (HTTP, KServe's error shape) or PERMISSION_DENIED (gRPC): stoker's own reload path talks to its
# backend's port, never through here.
PUBLIC_HTTP_EXACT = ("/v2", "/v2/health/live", "/v2/health/ready")
PUBLIC_HTTP_MODEL = r"^/v2/models/[^/]+(/versions/[^/]+)?(/ready|/config|/infer|/generate|/generate_stream)?$"
GRPC_SERVICE = "/inference.GRPCInferenceService/"
PUBLIC_GRPC = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
               "ModelInfer", "ModelStreamInfer")
REFUSED_HTTP = '{"error": "this route is not served at the public endpoint (stoker serves inference, health, metadata)"}'
# The ensemble's tokenizer steps are its internals, not a client's model (upstream's clients call `ensemble` or
# `tensorrt_llm`). They are also the only models stoker serves that are not decoupled, and the CPU image's Triton
# (2.51) allocates an HTTP /infer input by its declared shape before reading its data: a small body declaring
# [4294967296, 1] took 12.7 GiB, [2**62, 1] killed tritonserver (SIGSEGV). Triton bounds that itself since
# triton-inference-server/server PR #8676 (2026-02, "Avoid overflows when reading json inputs"; 26.07 has it), and
# a decoupled model refuses /infer before parsing; so the stable address serves no route of these two.
INTERNAL_MODELS = ("preprocessing", "postprocessing")
REFUSED_INTERNAL = ('{"error": "this model is an internal step of the ensemble and is not served at the public '
                    'endpoint; call the ensemble"}')
REFUSED_GRPC = "this method is not served at the public endpoint (stoker serves inference, health, metadata)"

# API keys (stoker.serving.api_keys): every route but health needs `authorization: Bearer KEY` (gRPC: the same
# metadata), checked before the routes above. The proxy holds only the keys' sha256 digests, in a file it loads
# as a key list that the runtime API can replace. Unauthenticated: 401 in the shape the route's clients read.
HEALTH_HTTP = ("/v2/health/live", "/v2/health/ready")
HEALTH_GRPC = ("ServerLive", "ServerReady")
BEARER = "bearer "  # the scheme and its one space; the key is what follows (bytes(7))
UNAUTHORIZED = "an API key is required: authorization: Bearer KEY"
UNAUTHORIZED_OPENAI = ('{"error": {"message": "Incorrect or missing API key: send authorization: Bearer KEY", '
                       '"type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}')
UNAUTHORIZED_KSERVE = '{"error": "an API key is required: authorization: Bearer KEY"}'

# Health checks: every backend server is checked on its backend's HTTP port (Triton's readiness, whatever section
# it serves: the gRPC and metrics ports answer no HTTP/1 health route), so a replica that stops or restarts loses
# its share of traffic until it is ready again. A refused connection fails a check at once: with fastinter a dead
# replica is DOWN about CHECK_INTER + (CHECK_FALL - 1) * CHECK_FASTINTER after it died; meanwhile `retry-on
# conn-failure` + `redispatch` send its requests to a sibling. A slow answer (a saturated server) is not a failure
# before CHECK_TIMEOUT. A server in maint (the other slot) is not checked; `set server ... state ready` brings it
# back UP at once (the candidate was proven by stage), and the next failed checks take it DOWN again.
HEALTH_URI = "/v2/health/ready"
CHECK_INTER, CHECK_FASTINTER, CHECK_FALL, CHECK_RISE, CHECK_TIMEOUT = "2s", "1s", 3, 2, "5s"
# Access log: one line per request on the proxy's stdout (`docker logs <proxy>`; Docker's json-file driver rotates
# it, engine.LOG_CONFIG). HAProxy's httplog format: client, frontend, backend/server, timers, status, bytes, request
# line. It logs no header unless `capture request header` asks for one, and stoker captures none: the
# authorization header (an API key) never reaches the log.


def server_name(slot: str, replica: int = 0) -> str:
    return slot if replica == 0 else f"{slot}_{replica}"


def slot_of(server: str) -> str:
    return server.split("_", 1)[0]


def _replica_ports(ports: Ports | list[Ports] | tuple[Ports, ...] | None) -> list[Ports]:
    """A slot's ports, one per replica (a single Ports is one replica). Pure."""
    if ports is None:
        return []
    return [ports] if isinstance(ports, Ports) else list(ports)


class ProxyApiError(Exception):
    """The proxy's runtime API is unreachable or refused a command."""


@dataclass(frozen=True)
class ProxyLayout:
    """What the proxy routes: the listening ports and, per slot, the backend's ports; ``live`` is routed to."""

    listen: Ports
    slots: Mapping[str, Ports | None]
    live: str | None
    openai: str | None = None  # the OpenAI service's unix socket (as the proxy sees it); None: no /v1/ route
    openai_grpc: str | None = None  # where the gRPC frontend also binds for that service (a unix socket)
    address: str = "127.0.0.1"  # where the frontends bind (deploy.listen)
    keys: str | None = None  # the file of API key digests (as the proxy sees it); None: no key asked
    tls: str | None = None  # the PEM (certificate + key) the frontends serve TLS with; None: cleartext
    replicas: int = 1  # server lines per slot (deploy.replicas); slots then map to one Ports per replica
    metrics_openai: bool = False  # the backends' metrics-role port also serves /v1/ (Triton's OpenAI frontend)
    limits: edge.EdgeLimits = edge.EdgeLimits()  # deploy.limits: bounds per client and in all (edge.py)


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(layout: ProxyLayout, mount: str = MOUNT) -> str:
    """The haproxy.cfg for ``layout``. Pure."""
    lines = [
        "# Written by stoker; rewritten on every switch (the running proxy is switched through its runtime API).",
        "global",
        f"    stats socket {mount}/{SOCKET_NAME} mode 600 level admin",
        "    stats timeout 30s",
        f"    maxconn {layout.limits.max_connections}",
        *edge.global_lines(),
        "    log stdout format raw local0",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlognull",  # a port probe (connect, close) is no request
        # A streamed answer is many small writes. By default HAProxy may hold a small write back to merge it with
        # the next (configuration manual, "option http-no-delay"): measured here, a 4-token SSE stream reached the
        # client all at once at ~86 ms through the proxy against ~22 ms for the first token straight from Triton.
        "    option http-no-delay",
        f"    timeout check {CHECK_TIMEOUT}",
        "    timeout connect 2s",
        f"    timeout client {STREAM_TIMEOUT}",
        f"    timeout server {STREAM_TIMEOUT}",
        f"    timeout tunnel {STREAM_TIMEOUT}",
        *edge.defaults_lines(layout.limits),
        "    timeout http-keep-alive 5m",
        # A proxy handover soft-stops the old proxy (promote.handover). By default HAProxy then closes idle
        # keep-alive connections at once, and a client writing its next request on one meets a broken pipe (a CI
        # run did). With this option (HAProxy >= 2.6, configuration manual "option idle-close-on-response") the old
        # proxy answers that next request and closes the connection after the response instead.
        "    option idle-close-on-response",
        "    timeout client-fin 5s",
        # A backend that refuses the connection (just stopped) gets the request again, elsewhere if possible.
        "    retries 3",
        "    retry-on conn-failure",
        "    option redispatch",
        "",
    ]
    for section, attr, proto in SECTIONS:
        # /v1/ is named once per frontend: keys answer it in OpenAI's shape, the public rules let it through.
        names_v1 = ((section == "http" and (layout.keys or layout.openai))
                    or (section == "metrics" and layout.metrics_openai))
        lines += [f"frontend {section}",
                  f"    bind {_bind(layout.address)}:{getattr(layout.listen, attr)}{proto}{_tls(section, layout.tls)}",
                  *([f"    bind unix@{layout.openai_grpc} mode 600 proto h2"]
                    if section == "grpc" and layout.openai_grpc else []),
                  *([f"    acl openai path_beg {OPENAI_PATH}"] if names_v1 else []),
                  *edge.frontend_lines(section, layout.limits, bool(names_v1)),
                  *(_keyed(section, layout.keys) if layout.keys else []),
                  *_public_only(section, bool(layout.openai), layout.metrics_openai)]
        if section == "http" and layout.openai:
            lines += [f"    use_backend {OPENAI_BACKEND} if openai"]
        lines += [f"    default_backend {section}", ""]
        lines.append(f"backend {section}")
        if section != "grpc":  # a gRPC call's body is a stream: never waited for whole
            lines += edge.backend_lines(layout.limits, openai_shape=False)
        if section == "http":
            lines += triton_input_errors()
        if layout.replicas > 1:
            lines.append("    balance leastconn")  # long streams: count open ones, not turns
        lines += ["    option httpchk", f"    http-check send meth GET uri {HEALTH_URI} ver HTTP/1.1 hdr host localhost",
                  "    http-check expect status 200",
                  f"    default-server inter {CHECK_INTER} fastinter {CHECK_FASTINTER} fall {CHECK_FALL} "
                  f"rise {CHECK_RISE}"]
        for slot in SLOTS:
            given = _replica_ports(layout.slots.get(slot))
            for r in range(layout.replicas):
                ports = given[r] if r < len(given) else PLACEHOLDER
                off = "" if slot == layout.live and r < len(given) else " disabled"
                lines.append(f"    server {server_name(slot, r)} 127.0.0.1:{getattr(ports, attr)}{proto}"
                             f"{_check(ports.http, bool(proto))}{off}")
        lines.append("")
    if layout.openai:
        lines.append(f"backend {OPENAI_BACKEND}")
        lines += edge.backend_lines(layout.limits, openai_shape=True)
        for status in (502, 503, 504):
            lines.append(f"    http-error status {status} content-type application/json string "
                         + _quoted(OPENAI_DOWN % status))
        lines += [f"    server {OPENAI_BACKEND} {layout.openai}", ""]
    lines += edge.table_lines(layout.limits)
    return "\n".join(lines)


def _check(http_port: int, h2: bool) -> str:
    """A server line's health check: readiness on its backend's HTTP port, spoken in HTTP/1 (check-proto: a gRPC
    server's check would otherwise speak its h2). Pure."""
    return f" check port {http_port}{' check-proto h1' if h2 else ''}"


def _bind(address: str) -> str:
    """HAProxy's spelling: "" for every IPv4 interface, brackets around an IPv6 address."""
    if address == "0.0.0.0":
        return ""
    return f"[{address}]" if ":" in address else address


def _tls(section: str, pem: str | None) -> str:
    if not pem:
        return ""
    return f" ssl crt {pem} alpn {'h2' if section == 'grpc' else 'http/1.1'}"


def _keyed(section: str, digests_file: str) -> list[str]:
    """The frontend lines that answer 401 to a request without a known key (health stays open)."""
    lines = [f"    acl bearer req.fhdr(authorization) -m beg -i {_quoted(BEARER)}",
             f"    acl key_ok req.fhdr(authorization),bytes({len(BEARER)}),sha2(256),hex,lower -f {digests_file}"]
    if section == "http":
        return [*lines, f"    acl health path {' '.join(HEALTH_HTTP)}",
                "    http-request return status 401 content-type application/json hdr www-authenticate Bearer "
                f"string {_quoted(UNAUTHORIZED_OPENAI)} if openai !bearer or openai !key_ok",
                "    http-request return status 401 content-type application/json hdr www-authenticate Bearer "
                f"string {_quoted(UNAUTHORIZED_KSERVE)} if !health !bearer or !health !key_ok"]
    if section == "grpc":
        # UNAUTHENTICATED (16), trailers-only, as the refused routes below.
        return [*lines, f"    acl health path {' '.join(GRPC_SERVICE + m for m in HEALTH_GRPC)}",
                "    http-request return status 200 hdr grpc-status 16 "
                f"hdr grpc-message {_quoted(UNAUTHORIZED.replace(' ', '%%20'))} if !health !bearer or !health !key_ok"]
    return [*lines, "    http-request return status 401 content-type text/plain hdr www-authenticate Bearer "
            f"string {_quoted(UNAUTHORIZED)} if !bearer or !key_ok"]


def _public_only(section: str, openai: bool, metrics_openai: bool = False) -> list[str]:
    """The frontend lines that refuse every route but the public ones (see PUBLIC_*; /v1/ with an OpenAI service,
    on the metrics port where the backends host Triton's OpenAI frontend there)."""
    if section == "http":
        return [f"    acl public path {' '.join(PUBLIC_HTTP_EXACT)}",
                f"    acl public path_reg {PUBLIC_HTTP_MODEL}",
                f"    http-request return status 403 content-type application/json string {_quoted(REFUSED_HTTP)} "
                f"if !public{' !openai' if openai else ''}",
                f"    acl internal_model path_reg ^/v2/models/({'|'.join(INTERNAL_MODELS)})(/|$)",
                f"    http-request return status 403 content-type application/json string "
                f"{_quoted(REFUSED_INTERNAL)} if internal_model"]
    if section == "grpc":
        # A trailers-only gRPC answer: HTTP 200, grpc-status 7 (PERMISSION_DENIED); HAProxy sends no content-type
        # for a reply without a body, and gRPC clients read the status (tests/integration/test_endpoint_boundary.py).
        return [f"    acl public path {' '.join(GRPC_SERVICE + m for m in PUBLIC_GRPC)}",
                "    http-request return status 200 hdr grpc-status 7 "
                f"hdr grpc-message {_quoted(REFUSED_GRPC.replace(' ', '%%20'))} if !public"]  # log-format: %% is %
    if metrics_openai:
        return ["    http-request return status 403 content-type text/plain string \"only /metrics and /v1/ are served "
                "here\" if !{ path /metrics } !openai"]
    return ["    http-request return status 403 content-type text/plain string \"only /metrics is served here\" "
            "if !{ path /metrics }"]



# ---------------------------------------------------------------- Triton's client-input errors (issue 51)
# Triton (2.51, the stoker/triton-cpu image; probed through tests/integration/test_fuzz_triton.py) answers a request
# whose JSON it cannot read as the inputs' types with HTTP 500: its HTTP frontend reports the JSON parser's failure as
# TRITONSERVER_ERROR_INTERNAL. `{"text_input": null}`, `"stream": 2147483648`, `"stop_words": {}` (a BYTES input), an
# invalid UTF-8 body: all 500, though the client sent the error. Other input mistakes (a missing input, a wrong
# datatype, a wrong shape) already answer 400. The proxy turns exactly those parse failures into 400, matched on the
# start of Triton's own error body, on the inference routes only: every other 500 (a model that raises, a backend
# that fails) stays a server error. Each prefix is Triton's own wording before any quoted input (a model's error
# would be mapped only if it began with the same words). Response side, because the failure is Triton's
# to find: re-validating every tensor's JSON against the model's config in the proxy would be a second, drifting
# copy of Triton's parser. `http-response wait-for-body` (HAProxy >= 2.4; the proxy image is 2.6) waits for the
# error's body (a few hundred bytes, sent whole) only when the status is 500 or 501, so a stream (200) passes as
# before. gRPC needs nothing: Triton answers the same mistakes there with INVALID_ARGUMENT (or UNIMPLEMENTED for
# ModelInfer on a decoupled model), in the stream's error_message for ModelStreamInfer.
TRITON_INPUT_ROUTE = r"^/v2/models/[^/]+(/versions/[^/]+)?/(infer|generate|generate_stream)$"
# 500 bodies that begin so are Triton's parse failures of the client's JSON.
TRITON_PARSE_ERRORS = (
    '{"error":"failed to parse the request JSON buffer: ',  # not JSON: bad UTF-8, empty, cut short
    '{"error":"Unable to parse ',  # a field of the wrong JSON type: 'data', 'shape', 'inputs', 'id', JSON bytes array
    '{"error":"attempt to get members for non-object"',  # generate's body is JSON but not an object
    '{"error":"Expected JSON object for keyword: ',  # generate's "parameters" not an object
)
# 501 bodies that are the client's choice of route or encoding, not a missing server feature: /infer on a decoupled
# model (Triton's gRPC says UNIMPLEMENTED, and /generate_stream serves it) and a Content-Encoding Triton lacks. The
# first comes as text/plain though its body is JSON.
TRITON_ROUTE_ERRORS = (
    '{"error":"HTTP end point doesn\'t support models with decoupled transaction policy"',
    '{"error":"Unsupported compression type"',
)


def triton_input_errors() -> list[str]:
    """The HTTP backend's lines that answer Triton's client-input errors 400, keeping Triton's body (its
    ``{"error": "..."}`` shape). Pure."""
    on_route = "{ var(txn.triton_input) -m bool }"
    return [f"    acl triton_input path_reg {TRITON_INPUT_ROUTE}",
            "    http-request set-var(txn.triton_input) bool(true) if triton_input",
            f"    http-response wait-for-body time 1s if {on_route} {{ status 500:501 }}",
            f"    acl triton_parse_error res.body -m beg {' '.join(_quoted(t) for t in TRITON_PARSE_ERRORS)}",
            f"    acl triton_route_error res.body -m beg {' '.join(_quoted(t) for t in TRITON_ROUTE_ERRORS)}",
            f"    http-response set-header content-type application/json if {on_route} {{ status 501 }} "
            "triton_route_error",
            f"    http-response set-status 400 if {on_route} {{ status 500 }} triton_parse_error",
            f"    http-response set-status 400 if {on_route} {{ status 501 }} triton_route_error"]

# ---------------------------------------------------------------- runtime API


# sun_path holds 108 bytes: a STOKER_HOME deep in a tree (a CI workspace, pytest's tmp) makes the socket's path
# longer than connect() accepts, so a long one is reached through a short link to its folder.
_SUN_PATH_MAX = 100


def _connectable(sock_path: Path) -> str:
    path = str(sock_path)
    if len(path.encode()) <= _SUN_PATH_MAX:
        return path
    folder = str(Path(path).parent.resolve())
    link = Path(tempfile.gettempdir()) / f"stoker-sock-{hashlib.sha256(folder.encode()).hexdigest()[:16]}"
    if not (link.is_symlink() and os.readlink(link) == folder):
        tmp = link.with_name(f"{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(folder)
        os.replace(tmp, link)  # atomic: a concurrent caller sees the old link or the new one
    return str(link / Path(path).name)


def command(sock_path: Path, cmd: str, timeout_s: float = 5.0) -> str:
    """Send one line (commands separated by ';') to the admin socket; returns the answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(_connectable(sock_path))
            s.sendall(cmd.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
    except OSError as err:
        raise ProxyApiError(f"proxy runtime API at {sock_path} did not answer: {err}") from None
    answer = b"".join(chunks).decode("utf-8", "replace")
    for bad in ("Unknown command", "No such server", "No such backend", "Require 'backend/server'",
                "Permission denied", "Invalid", "not found"):
        if bad in answer:
            raise ProxyApiError(f"proxy refused {cmd!r}: {answer.strip().splitlines()[0]}")
    return answer


def switch_commands(to_slot: str, ports: Ports | list[Ports], drain: str | None, replicas: int = 1) -> str:
    """Point ``to_slot``'s replicas at ``ports`` (one per replica) and make them the only ready servers; ``drain``'s
    replicas finish their requests; a replica with no ports goes to maint. Pure."""
    given = _replica_ports(ports)
    cmds = []
    for section, attr, _ in SECTIONS:
        for r in range(replicas):
            server = f"{section}/{server_name(to_slot, r)}"
            if r < len(given):
                cmds.append(f"set server {server} addr 127.0.0.1 port {getattr(given[r], attr)}")
                # The check follows the backend: its port is fixed (`port` on the server line) unless set here.
                cmds.append(f"set server {server} check-port {given[r].http}")
                cmds.append(f"set server {server} state ready")
            else:
                cmds.append(f"set server {server} state maint")
        if drain:
            cmds += [f"set server {section}/{server_name(drain, r)} state drain" for r in range(replicas)]
    return "; ".join(cmds)


def maint_commands(slot: str, replicas: int = 1) -> str:
    return "; ".join(f"set server {section}/{server_name(slot, r)} state maint"
                     for section, _, _ in SECTIONS for r in range(replicas))


def end_sessions_commands(slot: str, replicas: int = 1) -> str:
    """Close every stream the proxy holds open to ``slot`` (its clients see the stream end and reconnect). Pure."""
    return "; ".join(f"shutdown sessions server {section}/{server_name(slot, r)}"
                     for section, _, _ in SECTIONS for r in range(replicas))


@dataclass(frozen=True)
class ServerState:
    slot: str
    port: int
    ready: bool  # taking new requests (admin state clear); drain and maint are not
    draining: bool


def parse_servers_state(text: str) -> dict[str, dict[str, ServerState]]:
    """``show servers state`` → {backend: {slot: ServerState}}. Pure."""
    header: list[str] = []
    out: dict[str, dict[str, ServerState]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            header = line[1:].split()
            continue
        fields = line.split()
        if not header or len(fields) < len(header):
            continue
        row = dict(zip(header, fields))
        admin = int(row.get("srv_admin_state", "0"))
        # admin state bits: 0x01 forced maint, 0x02 inherited maint, 0x08 forced drain, 0x10/0x20 other drains/maints
        maint = bool(admin & 0x23)
        drain = bool(admin & 0x18) and not maint
        out.setdefault(row["be_name"], {})[row["srv_name"]] = ServerState(
            slot=row["srv_name"], port=int(row.get("srv_port", "0")), ready=not maint and not drain,
            draining=drain)
    return out


def parse_stat_sessions(text: str) -> dict[tuple[str, str], int]:
    """``show stat`` CSV → {(backend, server): current sessions}. Pure."""
    return parse_stat_counter(text, "scur")


def parse_stat_counter(text: str, column: str) -> dict[tuple[str, str], int]:
    """``show stat`` CSV → {(backend, server): that numeric column} for the slots' servers. Pure."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    i_px, i_sv, i_n = cols.index("pxname"), cols.index("svname"), cols.index(column)
    out = {}
    for line in lines[1:]:
        f = line.split(",")
        if len(f) > i_n and slot_of(f[i_sv]) in SLOTS:
            out[(f[i_px], f[i_sv])] = int(f[i_n] or 0)
    return out


def parse_stat_status(text: str) -> dict[tuple[str, str], str]:
    """``show stat`` CSV → {(backend, server): status} (UP, DOWN, MAINT, DRAIN, "UP 1/2" while a check turns). Pure."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    i_px, i_sv, i_st = cols.index("pxname"), cols.index("svname"), cols.index("status")
    return {(f[i_px], f[i_sv]): f[i_st] for f in (ln.split(",") for ln in lines[1:])
            if len(f) > i_st and slot_of(f[i_sv]) in SLOTS}


def live_slot(states: dict[str, dict[str, ServerState]]) -> str | None:
    """The slot ready in every section (the one the proxy routes to), if exactly one is."""
    ready = [s for s in SLOTS if all(states.get(sec, {}).get(s, ServerState(s, 0, False, False)).ready
                                     for sec, _, _ in SECTIONS)]
    return ready[0] if len(ready) == 1 else None


class Runtime:
    """The runtime API of one running proxy (a unix socket in its state folder)."""

    def __init__(self, state_dir: Path, replicas: int = 1) -> None:
        self.sock = state_dir / SOCKET_NAME
        self.replicas = replicas

    def servers(self) -> dict[str, dict[str, ServerState]]:
        return parse_servers_state(command(self.sock, "show servers state"))

    def sessions(self, slot: str) -> int:
        """Requests/streams the proxy has open to ``slot``'s backends (every replica), over all sections."""
        stats = parse_stat_sessions(command(self.sock, "show stat"))
        return sum(n for (_, srv), n in stats.items() if slot_of(srv) == slot)

    def bytes_out(self, slot: str) -> int:
        """Bytes the proxy has passed from ``slot``'s backends to clients so far (``bout``, every replica and section);
        HAProxy adds to it as a stream's data goes through, not only when the stream ends."""
        stats = parse_stat_counter(command(self.sock, "show stat"), "bout")
        return sum(n for (_, srv), n in stats.items() if slot_of(srv) == slot)

    def status(self) -> dict[tuple[str, str], str]:
        """Each server's status as its health checks and admin state make it (``show stat``)."""
        return parse_stat_status(command(self.sock, "show stat"))

    def switch(self, to_slot: str, ports: Ports | list[Ports], drain: str | None) -> None:
        command(self.sock, switch_commands(to_slot, ports, drain, self.replicas))

    def maint(self, slot: str) -> None:
        command(self.sock, maint_commands(slot, self.replicas))

    def end_sessions(self, slot: str) -> None:
        command(self.sock, end_sessions_commands(slot, self.replicas))
