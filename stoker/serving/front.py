"""A fleet's front proxy: one HAProxy on the local engine spreading traffic across the hosts' stable endpoints
(least connections), health-checked on each host's HTTP readiness; a host that rolls is set to `drain` through the
runtime API (no new requests, those in flight finish), then back to `ready`.

Each host's own proxy keeps its switch lossless; the front adds that a host being rolled takes no new work, and
that a host whose endpoint stops answering (its engine gone) leaves the rotation after a failed check, its requests
retried on another host when the connection is refused.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..containers import engine
from ..spec.schema import Spec
from . import haproxy

CONFIG = "front.cfg"
SECTIONS = ("http", "grpc")
READY_TIMEOUT_S = 30.0


class FrontError(engine.DeployError):
    """The front proxy did not start or its runtime API refused a command."""


def render(spec: Spec, mount: str = haproxy.MOUNT) -> str:
    """The front's haproxy.cfg: a frontend per port of fleet.front, a server per host in each backend. Pure."""
    fleet, front = spec.fleet, spec.fleet.front
    lines = ["# Written by stoker: a fleet's front proxy (stoker/serving/front.py).", "global",
             f"    stats socket {mount}/{haproxy.SOCKET_NAME} mode 600 level admin", "    stats timeout 30s",
             "    log stdout format raw local0", "", "defaults", "    mode http", "    log global",
             "    option http-no-delay", "    timeout connect 2s", f"    timeout client {haproxy.STREAM_TIMEOUT}",
             f"    timeout server {haproxy.STREAM_TIMEOUT}", "    timeout check 5s",
             # A host that refuses the connection (its proxy or engine gone) costs a retry elsewhere, not an error.
             "    retries 3", "    option redispatch 1", "    retry-on conn-failure empty-response", ""]
    for section in SECTIONS:
        port = getattr(front, section)
        h2 = " proto h2" if section == "grpc" else ""
        lines += [f"frontend {section}", f"    bind 127.0.0.1:{port}{h2}", f"    default_backend {section}", "",
                  f"backend {section}", "    balance leastconn", "    option httpchk GET /v2/health/ready"]
        for h in fleet.hosts:
            ports = h.ports or spec.deploy.ports
            # Readiness on the host's HTTP port, in HTTP/1 (a gRPC server's check would otherwise speak its h2).
            lines.append(f"    server {h.name} {h.address}:{getattr(ports, section)}{h2} check port {ports.http}"
                         f"{' check-proto h1' if h2 else ''} inter 1s fastinter 500ms fall 2 rise 1")
        lines.append("")
    return "\n".join(lines)


def state_dir(home: Path, spec: Spec) -> Path:
    return home / "front" / spec.deploy.name


def ensure(spec: Spec, home: Path, log) -> Path:
    """The front runs on the local engine with the spec's hosts; started (or restarted on a new config) if not.
    Returns its state folder (the runtime API's socket)."""
    folder = state_dir(home, spec)
    folder.mkdir(parents=True, exist_ok=True)
    config = render(spec)
    client = engine.connect(None)
    name = engine.front_name(spec.deploy.name)
    existing = next((c for c in client.containers.list(all=True, filters={"name": name}) if c.name == name), None)
    path = folder / CONFIG
    if existing is not None and existing.status == "running" and path.exists() and path.read_text() == config:
        return folder
    if existing is not None:
        existing.remove(force=True)
    path.write_text(config)
    (folder / haproxy.SOCKET_NAME).unlink(missing_ok=True)
    engine.start_front(client, spec.deploy.name, spec.deploy.proxy_image, folder, haproxy.MOUNT, CONFIG)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            haproxy.command(folder / haproxy.SOCKET_NAME, "show info")
            break
        except haproxy.ProxyApiError as err:
            if time.monotonic() > deadline:
                raise FrontError(f"fleet front proxy did not start within {READY_TIMEOUT_S:g} s: {err}") from None
            time.sleep(0.2)
    log(f"fleet front: http 127.0.0.1:{spec.fleet.front.http}, grpc 127.0.0.1:{spec.fleet.front.grpc} across "
        f"{', '.join(h.name for h in spec.fleet.hosts)}")
    return folder


def set_state(folder: Path, host: str, state: str) -> None:
    """`drain` or `ready` for ``host`` in every section of the front."""
    haproxy.command(folder / haproxy.SOCKET_NAME,
                    "; ".join(f"set server {s}/{host} state {state}" for s in SECTIONS))


def states(folder: Path) -> dict[str, str]:
    """host → the front's status of it (UP, DOWN, DRAIN, MAINT...) in its HTTP section; {} when it does not
    answer."""
    try:
        text = haproxy.command(folder / haproxy.SOCKET_NAME, "show stat")
    except haproxy.ProxyApiError:
        return {}
    return parse_states(text)


def parse_states(text: str) -> dict[str, str]:
    """``show stat`` CSV → host → status in the HTTP section. Pure."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    i_px, i_sv, i_st = cols.index("pxname"), cols.index("svname"), cols.index("status")
    return {f[i_sv]: f[i_st] for f in (ln.split(",") for ln in lines[1:])
            if len(f) > i_st and f[i_px] == "http" and f[i_sv] not in ("FRONTEND", "BACKEND")}


def remove(spec: Spec) -> None:
    client = engine.connect(None)
    name = engine.front_name(spec.deploy.name)
    for c in client.containers.list(all=True, filters={"name": name}):
        if c.name == name:
            c.remove(force=True)
