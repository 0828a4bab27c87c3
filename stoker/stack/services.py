"""Lifecycle of the local background services (S3, Hub mirror, ...) the demo and tests run against.

Each service is a detached OS process in its own session, logging to ``STATE/logs/<name>.log``
and recorded in ``STATE/run/<name>.json``. Only processes recorded there are ever signalled,
and a record is trusted only while its pid still belongs to the process we started (the kernel
start time is stored next to the pid, so a recycled pid is never mistaken for ours).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..containers import port_lease
from ..errors import StokerError

LOG_TAIL_LINES = 20
_POLL_S = 0.1


class ServiceError(StokerError):
    """A background service could not be started, found or stopped."""


class PortInUse(ServiceError):
    """The requested port is held by a process that is not one of our services."""


class ServiceDied(ServiceError):
    """The service process exited before it became ready."""


class ServiceTimeout(ServiceError):
    """The service did not become ready before its deadline."""


@dataclass(frozen=True)
class ServiceHandle:
    """A running service as recorded in its pid file."""

    name: str
    pid: int
    port: int
    argv: list[str]
    started_at: float
    proc_start: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def run_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "run"


def log_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "logs"


def _pid_file(name: str, state_dir: Path) -> Path:
    return run_dir(state_dir) / f"{name}.json"


def port_open(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when port can be bound on host (nothing listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR so a socket lingering in TIME_WAIT does not count as busy;
        # a listening socket still makes bind fail on Linux.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", exclude: tuple[int, ...] = ()) -> int:
    """A port free right now, chosen below the kernel's ephemeral range.

    bind(0) hands out ephemeral ports, which outgoing connections also take: a port picked that
    way can be gone by the time a server binds it. Picking outside that range closes the race
    against clients; a lease (stoker/containers/port_lease.py) closes it against every other pick of
    stoker's on this host.
    """
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, max(20001, low))
        if (port not in exclude and port_free(port, host) and port_free(port, "0.0.0.0")
                and port_lease.claim(port)):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range: fall back
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def reuse_or_port(name: str, state_dir: Path, port: int | None) -> tuple[ServiceHandle | None, int]:
    """Our running service when it suits the request, else the port to start one on (a free one if None)."""
    running = is_running(name, state_dir)
    if running is not None and (port is None or running.port == port):
        return running, running.port
    return None, port if port is not None else free_port()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _proc_start_ticks(pid: int) -> int | None:
    """Kernel start time of pid (clock ticks since boot), None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def _reap(pid: int) -> None:
    """Collect pid's exit status if it is our child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _alive(handle: ServiceHandle) -> bool:
    _reap(handle.pid)
    return _proc_start_ticks(handle.pid) == handle.proc_start


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _read_record(name: str, state_dir: Path) -> ServiceHandle | None:
    path = _pid_file(name, state_dir)
    try:
        data = json.loads(path.read_text())
        return ServiceHandle(**data)
    except (OSError, ValueError, TypeError):
        return None


def is_running(name: str, state_dir: Path) -> ServiceHandle | None:
    """The handle of service name if its recorded process is alive and its port accepts TCP."""
    handle = _read_record(name, state_dir)
    if handle is None or not _alive(handle) or not port_open(handle.port):
        return None
    return handle


def start_service(
    name: str,
    argv: Sequence[str],
    port: int,
    state_dir: Path,
    env: Mapping[str, str] | None = None,
    ready: Callable[[], bool] | None = None,
    timeout_s: float = 60,
    cwd: Path | None = None,
) -> ServiceHandle:
    """Launch argv as detached service name and wait until it serves on port.

    Returns the existing handle if service name already runs on port. env is added to
    os.environ. ready, if given, is polled after the port opens until it returns True.

    Raises:
        PortInUse: port is busy and not held by this service.
        ServiceDied: the process exited before becoming ready (message carries the log tail).
        ServiceTimeout: not ready within timeout_s (the process is stopped).
    """
    state_dir = Path(state_dir)
    running = is_running(name, state_dir)
    if running is not None and running.port == port:
        return running
    if running is not None:
        raise ServiceError(f"service {name} already runs on port {running.port}, not {port}; stop it first")
    stale = _read_record(name, state_dir)
    if stale is not None and _alive(stale):
        # Alive but not serving: a half-started leftover of ours; replace it.
        stop_service(name, state_dir)
    _pid_file(name, state_dir).unlink(missing_ok=True)
    if not port_free(port):
        raise PortInUse(f"port {port} is already in use by a process that is not stoker service {name}")

    run_dir(state_dir).mkdir(parents=True, exist_ok=True)
    log_dir(state_dir).mkdir(parents=True, exist_ok=True)
    log_path = log_dir(state_dir) / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=str(cwd or state_dir),
            # Own session: the service outlives this process and its whole group can be signalled.
            start_new_session=True,
        )
    proc_start = _proc_start_ticks(proc.pid)
    handle = ServiceHandle(
        name=name,
        pid=proc.pid,
        port=port,
        argv=list(argv),
        started_at=time.time(),
        proc_start=proc_start if proc_start is not None else -1,
        log_path=str(log_path),
    )
    _pid_file(name, state_dir).write_text(json.dumps(asdict(handle), indent=1))

    deadline = time.monotonic() + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            _pid_file(name, state_dir).unlink(missing_ok=True)
            raise ServiceDied(
                f"service {name} exited with status {code} before serving on port {port}; "
                f"last log lines of {log_path}:\n{_log_tail(log_path)}"
            )
        if port_open(port) and (ready is None or ready()):
            return handle
        if time.monotonic() > deadline:
            stop_service(name, state_dir)
            raise ServiceTimeout(
                f"service {name} not ready on port {port} within {timeout_s:.0f} s; "
                f"last log lines of {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(_POLL_S)


def _signal_group(handle: ServiceHandle, sig: signal.Signals) -> None:
    try:
        os.killpg(handle.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(handle.pid, sig)


def _wait_gone(handle: ServiceHandle, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(handle):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def stop_service(name: str, state_dir: Path, timeout_s: float = 15) -> bool:
    """Stop service name (SIGTERM, then SIGKILL after timeout_s) and remove its pid file.

    Returns True if a live process was stopped, False if there was nothing to stop.
    """
    handle = _read_record(name, state_dir)
    stopped = False
    if handle is not None and _alive(handle):
        _signal_group(handle, signal.SIGTERM)
        if not _wait_gone(handle, timeout_s):
            _signal_group(handle, signal.SIGKILL)
            if not _wait_gone(handle, 5):
                raise ServiceError(f"service {name} (pid {handle.pid}) survived SIGKILL")
        stopped = True
    _pid_file(name, state_dir).unlink(missing_ok=True)
    return stopped


def stop_all(state_dir: Path, timeout_s: float = 15) -> list[str]:
    """Stop every service with a pid file under state_dir; returns the names that were running."""
    directory = run_dir(state_dir)
    if not directory.is_dir():
        return []
    names = sorted(path.stem for path in directory.glob("*.json"))
    return [name for name in names if stop_service(name, state_dir, timeout_s)]
