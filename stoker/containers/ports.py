"""Backend port choice: outside the kernel's ephemeral range, verified free, never shared.

A port inside the ephemeral range (32768–60999 by default) can be taken at any moment
by an outgoing connection's local end, so a port that was free at check time may not be
when Triton binds it (seen: Triton ready, then "Metrics service: socket already in use").
Pure: callers pass the probing function and the ports other backends already claim.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
# Below this, ports are conventionally reserved for well-known services.
LOWEST_BACKEND_PORT = 20000


class NoFreePorts(Exception):
    """No block of backend ports is free outside the ephemeral range."""


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    def items(self) -> tuple[tuple[str, int], ...]:
        return (("http", self.http), ("grpc", self.grpc), ("metrics", self.metrics))

    def values(self) -> tuple[int, int, int]:
        return (self.http, self.grpc, self.metrics)

    def label(self) -> str:
        return f"{self.http},{self.grpc},{self.metrics}"

    @classmethod
    def parse(cls, label: str) -> Ports:
        http, grpc, metrics = (int(p) for p in label.split(","))
        return cls(http, grpc, metrics)


def parse_ephemeral_range(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split())
    if not 0 < low <= high <= 65535:
        raise ValueError(f"not a port range: {text!r}")
    return low, high


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux); the usual default elsewhere."""
    try:
        return parse_ephemeral_range(path.read_text())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def backend_port_blocks(ephemeral: tuple[int, int], lowest: int = LOWEST_BACKEND_PORT) -> list[int]:
    """First ports of the 3-port blocks usable for backends: below the ephemeral range or above it."""
    low, high = ephemeral
    below = range(lowest, low - 2, 3)
    above = range(high + 1, 65536 - 2, 3)
    return [*below, *above]


def choose_backend_ports(
    is_free: Callable[[int], bool],
    claimed: Iterable[int] = (),
    ephemeral: tuple[int, int] | None = None,
    seed: str = "",
    avoid: Iterable[int] = (),
) -> Ports:
    """Three free ports for a new backend; none ephemeral, none claimed by another backend or in ``avoid``.

    The scan starts at a point derived from ``seed`` (the deployment name) so that deployments
    starting at once rarely probe the same block first.
    """
    taken = set(claimed) | set(avoid)
    blocks = backend_port_blocks(ephemeral or ephemeral_range())
    if not blocks:
        raise NoFreePorts("no ports outside the ephemeral range are available for backends")
    start = random.Random(seed).randrange(len(blocks))
    for base in blocks[start:] + blocks[:start]:
        block = (base, base + 1, base + 2)
        if any(p in taken for p in block):
            continue
        if all(is_free(p) for p in block):
            return Ports(*block)
    raise NoFreePorts("no block of 3 free ports outside the ephemeral range "
                      f"{ephemeral or ephemeral_range()} for a new backend")


def is_port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on all interfaces (as Triton and the proxy do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port in TIME_WAIT after the last server is free for the next one.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def address_missing(address: str) -> str | None:
    """Why this host cannot listen on ``address`` (one line), or None: a `deploy.listen` the host lacks would take
    the endpoint down only when the new proxy failed to bind, after the old one was removed."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError as err:
            return f"this host cannot listen on {address} ({err.strerror or err})"
    return None


def port_owner(port: int, proc: Path = Path("/proc")) -> str:
    """Who listens on TCP ``port``: 'pid N (command)' from /proc, or 'an unknown process'."""
    inodes = set()
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return "an unknown process"
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                target = fd.readlink().as_posix() if hasattr(fd, "readlink") else ""
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    comm = (pid_dir / "comm").read_text().strip()
                    return f"pid {pid_dir.name} ({comm})"
        except OSError:
            continue
    return "an unknown process"
