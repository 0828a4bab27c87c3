"""Deploy Triton Inference Server containers through the Docker engine.

One deployment name owns at most one serving container. A new model
repository digest is rolled out blue/green: the new container starts on free
ports (the requested ones, or the standby ports when the current container
holds them), and the old one is stopped only once the new one answers
``/v2/health/ready``. Containers use host networking so Triton reaches an S3
server on 127.0.0.1. Stoker only ever touches containers carrying its
``ai.stoker.managed`` label.

Errors: every failure is a ``DeployError`` subclass whose message's first line
is the cause (``DockerUnavailable``, ``ImageMissing``, ``PortInUse``, ``NotReady``).
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import docker
import docker.errors
import requests
from docker.models.containers import Container
from docker.types import Ulimit

from .errors import StokerError

Log = Callable[[str], None]

LABEL_MANAGED = "ai.stoker.managed"
LABEL_DEPLOYMENT = "ai.stoker.deployment"
LABEL_DIGEST = "ai.stoker.repo_digest"
LABEL_SLOT = "ai.stoker.slot"
# The next deploy reads the ports back from here: with host networking Docker
# itself does not know which ports a container listens on.
LABEL_PORTS = "ai.stoker.ports"
SLOTS = ("blue", "green")
LOG_TAIL_LINES = 20
STOP_TIMEOUT_S = 10
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class DeployError(StokerError):
    """Base of every deployment failure; the message's first line is the cause."""


class DockerUnavailable(DeployError):
    """No Docker daemon answers."""


class ImageMissing(DeployError):
    """The Triton image is not present in the daemon."""


class PortInUse(DeployError):
    """A port needed by the deployment is held by something other than this deployment."""


class NotReady(DeployError):
    """The new container never answered ready; the previous one (if any) keeps serving."""


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    def items(self) -> tuple[tuple[str, int], ...]:
        return (("http", self.http), ("grpc", self.grpc), ("metrics", self.metrics))

    def shifted(self, offset: int) -> Ports:
        return Ports(self.http + offset, self.grpc + offset, self.metrics + offset)

    def label(self) -> str:
        return f"{self.http},{self.grpc},{self.metrics}"

    @classmethod
    def parse(cls, label: str) -> Ports:
        http, grpc, metrics = (int(p) for p in label.split(","))
        return cls(http, grpc, metrics)


@dataclass(frozen=True)
class DeployRequest:
    name: str
    image: str
    repository_uri: str
    repo_digest: str
    # Secrets (S3 credentials): passed to the container only; repr=False keeps
    # them out of logs and tracebacks that print the request.
    env: dict[str, str] = field(default_factory=dict, repr=False)
    ports: Ports = field(default_factory=lambda: Ports(8000, 8001, 8002))
    standby_port_offset: int = 10
    shm_size: str = "256m"
    # Empty by default: this dockerd refuses memlock -1 (hard limit 8 MiB).
    ulimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    ready_timeout_s: float = 120.0
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"deployment name {self.name!r} must match {_NAME_RE.pattern}"
            )
        if self.standby_port_offset == 0:
            raise ValueError("standby_port_offset must not be 0")


@dataclass(frozen=True)
class DeployResult:
    container_id: str
    container_name: str
    http_url: str
    grpc_url: str
    ports: Ports
    reused: bool
    replaced: str | None


@dataclass(frozen=True)
class Slot:
    name: str
    ports: Ports


# ---------------------------------------------------------------- pure parts


def choose_slot(
    requested: Ports, offset: int, current: Slot | None, is_free: Callable[[int], bool]
) -> Slot:
    """Pick colour and ports for a new container next to ``current`` (the serving one).

    The requested ports when all are free; else, when the busy ones are held by
    ``current``, the standby ports (requested + offset). Raises PortInUse naming
    the first port held by anything else. Pure: ``is_free`` does the probing.
    """
    colour = "green" if current is not None and current.name == "blue" else "blue"
    ours = {p for _, p in current.ports.items()} if current else set()
    busy = [(key, port) for key, port in requested.items() if not is_free(port)]
    if not busy:
        return Slot(colour, requested)
    for key, port in busy:
        if port not in ours:
            raise PortInUse(
                f"port {port} (deploy.ports.{key}) is in use by another process"
            )
    standby = requested.shifted(offset)
    for key, port in standby.items():
        if port in ours or not is_free(port):
            raise PortInUse(
                f"port {port} (deploy.ports.{key} + standby_port_offset {offset}) "
                "is in use by another process"
            )
    return Slot(colour, standby)


def triton_args(
    repository_uri: str, ports: Ports, extra_args: Iterable[str] = ()
) -> list[str]:
    """Arguments appended to the image's ``tritonserver`` entrypoint."""
    return [
        f"--model-repository={repository_uri}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        *extra_args,
    ]


def http_status(url: str, timeout_s: float) -> int:
    """GET ``url``; the HTTP status, or OSError when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def wait_ready(
    url: str,
    timeout_s: float,
    *,
    request: Callable[[str, float], int] = http_status,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    exit_reason: Callable[[], str | None] = lambda: None,
    interval_s: float = 0.5,
) -> float:
    """Poll ``url`` until it answers 200; returns the seconds waited.

    Raises NotReady at the deadline, or at once when ``exit_reason()`` reports
    that the server process is gone (no point waiting for a dead container).
    """
    start = clock()
    deadline = start + timeout_s
    last = "no answer"
    while True:
        reason = exit_reason()
        if reason:
            raise NotReady(f"container exited before it was ready ({reason})")
        try:
            status = request(url, max(0.1, min(2.0, deadline - clock())))
            if status == 200:
                return clock() - start
            last = f"HTTP {status}"
        except OSError as err:  # refused, reset, timeout: the server is still starting
            last = str(err) or type(err).__name__
        if clock() >= deadline:
            raise NotReady(f"not ready after {timeout_s:g} s (last answer: {last})")
        sleep(interval_s)


def is_port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on all interfaces (as Triton does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: a port in TIME_WAIT after the last Triton is free for the next one.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------- docker parts


def connect(
    docker_host: str | None = None, timeout_s: int = 120
) -> docker.DockerClient:
    """A client for ``docker_host`` (None: DOCKER_HOST or the local socket) that answered a ping."""
    where = docker_host or "the default socket (DOCKER_HOST or /var/run/docker.sock)"
    try:
        client = (
            docker.DockerClient(base_url=docker_host, timeout=timeout_s)
            if docker_host
            else docker.from_env(timeout=timeout_s)
        )
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        raise DockerUnavailable(
            f"no Docker daemon answers at {where}: {_one_line(err)}"
        ) from err
    return client


def deploy(client: docker.DockerClient, req: DeployRequest, log: Log) -> DeployResult:
    """Serve ``req.repository_uri`` under ``req.name``; reuse, or replace blue/green.

    Raises ImageMissing, PortInUse (before starting anything), NotReady (new
    container removed, the old one untouched) or DockerUnavailable.
    """
    _require_image(client, req.image)
    mine = _containers(client, req.name)
    running = [c for c in mine if c.status == "running"]
    ready = [c for c in running if _is_ready(c)]

    for c in ready:
        if c.labels.get(LABEL_DIGEST) == req.repo_digest:
            log(
                f"{c.name} already serves {req.name} at digest {req.repo_digest[:12]}; reusing it"
            )
            return _result(c, reused=True, replaced=None)

    # The newest ready container is the one serving; anything else of this
    # deployment is a leftover of an interrupted or failed deploy.
    current = ready[0] if ready else None
    for c in mine:
        if c is not current:
            log(f"removing leftover container {c.name} ({c.status})")
            _stop_and_remove(c, log)
    current_slot = (
        Slot(current.labels[LABEL_SLOT], Ports.parse(current.labels[LABEL_PORTS]))
        if current
        else None
    )
    slot = choose_slot(req.ports, req.standby_port_offset, current_slot, is_port_free)

    name = f"stoker-{req.name}-{slot.name}"
    log(
        f"starting {name} from {req.image}: repository {req.repository_uri} "
        f"(digest {req.repo_digest[:12]}), ports http={slot.ports.http} grpc={slot.ports.grpc} "
        f"metrics={slot.ports.metrics}"
    )
    new = _start(client, req, slot, name)
    pump = _LogPump(new, log, f"[{name}]")
    try:
        waited = wait_ready(
            f"http://127.0.0.1:{slot.ports.http}/v2/health/ready",
            req.ready_timeout_s,
            exit_reason=lambda: _exit_reason(new),
        )
    except NotReady as err:
        pump.stop()
        tail = _log_tail(new)
        _stop_and_remove(new, log)
        kept = f"; {current.name} keeps serving" if current else ""
        raise NotReady(
            f"{name} never became ready: {err}{kept}\n"
            f"last {LOG_TAIL_LINES} log lines of {name}:\n{tail}"
        ) from None
    except BaseException:
        pump.stop()
        _stop_and_remove(new, log)
        raise
    pump.stop()
    log(f"{name} ready after {waited:.1f} s")

    replaced = None
    if current is not None:
        log(f"stopping previous container {current.name}")
        _stop_and_remove(current, log)
        replaced = current.name
    return _result(new, reused=False, replaced=replaced)


def find_serving(
    client: docker.DockerClient, name: str, repo_digest: str
) -> Container | None:
    """The running, ready container of deployment ``name`` at ``repo_digest``, if any."""
    for c in _containers(client, name):
        if (
            c.status == "running"
            and c.labels.get(LABEL_DIGEST) == repo_digest
            and _is_ready(c)
        ):
            return c
    return None


def remove_deployment(client: docker.DockerClient, name: str, log: Log) -> list[str]:
    """Stop and remove every container of deployment ``name``; returns their names."""
    removed = []
    for c in _containers(client, name):
        log(f"removing {c.name}")
        _stop_and_remove(c, log)
        removed.append(c.name)
    return removed


def _require_image(client: docker.DockerClient, image: str) -> None:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ImageMissing(
            f"image {image} is not in the Docker daemon; build it with "
            f"infra/image/build.sh {image}"
        ) from None
    except requests.exceptions.ConnectionError as err:
        raise DockerUnavailable(
            f"Docker daemon stopped answering: {_one_line(err)}"
        ) from err


def _containers(client: docker.DockerClient, name: str) -> list[Container]:
    """This deployment's managed containers (any state), newest first."""
    found = client.containers.list(
        all=True,
        filters={"label": [f"{LABEL_MANAGED}=true", f"{LABEL_DEPLOYMENT}={name}"]},
    )
    return sorted(found, key=_created_key, reverse=True)


def _created_key(c: Container) -> tuple[str, int]:
    # Docker trims trailing zeros of the nanoseconds, so compare the fraction as a number.
    created = str(c.attrs.get("Created", ""))
    whole, _, frac = created.rstrip("Z").partition(".")
    return whole, int(frac.ljust(9, "0")[:9] or 0)


def _start(
    client: docker.DockerClient, req: DeployRequest, slot: Slot, name: str
) -> Container:
    labels = {
        LABEL_MANAGED: "true",
        LABEL_DEPLOYMENT: req.name,
        LABEL_DIGEST: req.repo_digest,
        LABEL_SLOT: slot.name,
        LABEL_PORTS: slot.ports.label(),
    }
    try:
        return client.containers.run(
            req.image,
            triton_args(req.repository_uri, slot.ports, req.extra_args),
            name=name,
            detach=True,
            network_mode="host",
            labels=labels,
            environment=dict(req.env),
            shm_size=req.shm_size,
            ulimits=[
                Ulimit(name=k, soft=s, hard=h) for k, (s, h) in req.ulimits.items()
            ],
        )
    except docker.errors.APIError as err:
        # Created but failed to start (e.g. a refused rlimit): do not leave it behind.
        try:
            client.containers.get(name).remove(force=True)
        except docker.errors.DockerException:
            pass
        raise NotReady(f"{name} failed to start: {_one_line(err)}") from None


def _is_ready(c: Container) -> bool:
    try:
        http = Ports.parse(c.labels[LABEL_PORTS]).http
        return http_status(f"http://127.0.0.1:{http}/v2/health/ready", 2.0) == 200
    except (KeyError, ValueError, OSError):
        return False


def _exit_reason(c: Container) -> str | None:
    try:
        c.reload()
    except docker.errors.NotFound:
        return "container was removed"
    if c.status in ("exited", "dead"):
        return f"status {c.status}, exit code {c.attrs['State'].get('ExitCode')}"
    return None


def _log_tail(c: Container) -> str:
    try:
        text = c.logs(tail=10 * LOG_TAIL_LINES).decode("utf-8", "replace")
    except docker.errors.DockerException:
        return "(logs unavailable)"
    # Triton prints wide status tables last; they would push the load error
    # (e.g. "failed to load 'm'") out of the tail, so leave table and blank lines out.
    lines = [
        ln
        for ln in text.splitlines()
        if ln.strip() and ln.lstrip()[:1] not in ("|", "+")
    ]
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(no output)"


def _stop_and_remove(c: Container, log: Log, timeout_s: int = STOP_TIMEOUT_S) -> None:
    """Stop gracefully with a deadline, then kill: one SIGTERM to Triton has hung for minutes."""
    try:
        c.reload()
        if c.status == "running":
            c.stop(timeout=timeout_s)  # the daemon sends SIGKILL after timeout_s
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        log(f"stop of {c.name} failed ({_one_line(err)}); killing it")
    try:
        c.remove(force=True)  # force: SIGKILL if anything survived the stop
    except docker.errors.NotFound:
        pass


def _result(c: Container, reused: bool, replaced: str | None) -> DeployResult:
    ports = Ports.parse(c.labels[LABEL_PORTS])
    return DeployResult(
        container_id=c.id,
        container_name=c.name,
        http_url=f"http://127.0.0.1:{ports.http}",
        grpc_url=f"127.0.0.1:{ports.grpc}",
        ports=ports,
        reused=reused,
        replaced=replaced,
    )


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


class _LogPump:
    """Streams a container's output to ``log`` from a daemon thread until stopped."""

    def __init__(self, container: Container, log: Log, prefix: str) -> None:
        self._container, self._log, self._prefix = container, log, prefix
        self._stream = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"logs{prefix}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        pending = b""
        try:
            stream = self._container.logs(stream=True, follow=True)
            with self._lock:
                if self._stopped.is_set():
                    stream.close()
                    return
                self._stream = stream
            for chunk in stream:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._log(
                        f"{self._prefix} {line.decode('utf-8', 'replace').rstrip()}"
                    )
        # Closing the stream from stop() surfaces here as whatever the transport
        # raises (urllib3, requests, OSError); all of them just mean "done".
        except Exception:  # noqa: BLE001, S110
            pass

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()
            stream = self._stream
        if stream is not None:
            try:
                stream.close()
            except Exception:  # noqa: BLE001, S110 - already closed by the daemon side
                pass
        self._thread.join(timeout=2)


def check_deployable(
    client: docker.DockerClient, name: str, image: str, ports: Ports, offset: int
) -> None:
    """Preflight: what deploy() would refuse (missing image, a port held by others), without starting anything."""
    _require_image(client, image)
    running = [c for c in _containers(client, name) if c.status == "running"]
    current = running[0] if running else None
    current_slot = (
        Slot(current.labels[LABEL_SLOT], Ports.parse(current.labels[LABEL_PORTS]))
        if current is not None
        else None
    )
    choose_slot(ports, offset, current_slot, is_port_free)
