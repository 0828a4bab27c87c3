"""The Docker engine: start, inspect, stop and remove stoker's containers. Nothing else.

Three kinds of containers per deployment, all on the host's network (so Triton reaches an S3
server on 127.0.0.1) and all labelled ``ai.stoker.managed``; stoker never touches others:
- ``backend``: a Triton server on its own ports (chosen by ``serving.ports``), one per slot;
- ``proxy``: the deployment's stable endpoint (``serving.haproxy``), restarted by Docker;
- ``openai``: the OpenAI-compatible API behind the proxy's /v1/ (``serving.openai_service``), restarted by Docker.
Which backend is live, and when to switch, is decided elsewhere (``serving.topology``,
``serving.promote``).

Errors: every failure is a ``DeployError`` whose message's first line is the cause.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import requests
from docker.models.containers import Container
from docker.types import DeviceRequest, Ulimit

from ..errors import StokerError
from . import argv_secret
from .ports import Ports

Log = Callable[[str], None]

LABEL_MANAGED = "ai.stoker.managed"
LABEL_DEPLOYMENT = "ai.stoker.deployment"
LABEL_ROLE = "ai.stoker.role"  # backend | proxy
LABEL_DIGEST = "ai.stoker.repo_digest"
LABEL_SLOT = "ai.stoker.slot"
LABEL_REPLICA = "ai.stoker.replica"  # deploy.replicas: which of its slot's replicas (absent: 0)
LABEL_RUN = "ai.stoker.run_id"
# With host networking Docker does not know a container's ports: they are read back from here.
LABEL_PORTS = "ai.stoker.ports"
LABEL_ADDRESS = "ai.stoker.listen"  # the proxy's bind address (the stable endpoint's)
LABEL_INTERFACE = "ai.stoker.interface"  # how clients talk to the backend: its layout's interface (stoker.protocol)
LABEL_FRONT = "ai.stoker.front"  # what the proxy asks of clients: open, keys, tls:<digest of its PEM>
ROLE_BACKEND, ROLE_PROXY, ROLE_OPENAI = "backend", "proxy", "openai"
# A fleet's front proxy (stoker/serving/front.py) carries no deployment label: it is no host's deployment.
LABEL_FLEET, ROLE_FRONT = "ai.stoker.fleet", "front"
LOG_TAIL_LINES = 20
# The proxy and the OpenAI service log a line per request (their access logs): Docker's json-file driver keeps at
# most max-file files of max-size each, so a long-lived endpoint's logs never fill the host's disk.
LOG_CONFIG = {"Type": "json-file", "Config": {"max-size": "20m", "max-file": "5"}}
STOP_TIMEOUT_S = 10
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class DeployError(StokerError):
    """Base of every deployment failure; the message's first line is the cause."""


class DockerUnavailable(DeployError):
    """No Docker daemon answers."""


class ImageMissing(DeployError):
    """An image is not present in the daemon."""


class PortInUse(DeployError):
    """A port the deployment needs is held by something other than this deployment."""


class NotReady(DeployError):
    """A new backend never became ready (or did not stay ready); what served before keeps serving."""


@dataclass(frozen=True)
class BackendSpec:
    """How to run one Triton backend of deployment ``name``."""

    name: str
    image: str
    repository_uri: str
    repo_digest: str
    # Secrets (S3 credentials): passed to the container only; repr=False keeps them out of logs.
    env: dict[str, str] = field(default_factory=dict, repr=False)
    shm_size: str = "256m"
    # Empty by default: this dockerd refuses memlock -1 (hard limit 8 MiB).
    ulimits: dict[str, tuple[int, int]] = field(default_factory=dict)
    ready_timeout_s: float = 120.0
    extra_args: list[str] = field(default_factory=list)
    run_id: str = ""
    # What a GPU target supplies beyond the CPU image's defaults (stoker/targets/gpu.py): the serve command on a
    # backend's ports (None: the image's entrypoint is tritonserver and gets triton_args), an entrypoint to use
    # instead of the image's ("" clears it), host folders mounted read-only (host -> container), GPUs, labels.
    command: Callable[[Ports, list[str]], list[str]] | None = field(default=None, repr=False)
    entrypoint: str | None = None
    mounts: dict[str, str] = field(default_factory=dict)
    device_ids: tuple[int, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    interface: str = "ensemble"  # the layout's interface (stoker.protocol): what the smoke and the watch address
    # Called just before the container starts, with the Docker client: the labels it adds, or an exception that
    # refuses the start (the stand-in's GPU memory ledger, stoker/gpu/standin_ledger.py).
    admit: Callable[[docker.DockerClient], dict[str, str]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"deployment name {self.name!r} must match {_NAME_RE.pattern}")


# Backends and candidates run with host networking: they listen on loopback only, whatever the stable address,
# so that nothing but the proxy (and stoker's own checks on this host) reaches an unproven or drained backend.
BACKEND_ADDRESS = "127.0.0.1"


def triton_args(repository_uri: str, ports: Ports, extra_args: Iterable[str] = ()) -> list[str]:
    """Arguments appended to the image's ``tritonserver`` entrypoint."""
    return [f"--model-repository={repository_uri}", f"--http-address={BACKEND_ADDRESS}", f"--http-port={ports.http}",
            f"--grpc-address={BACKEND_ADDRESS}", f"--grpc-port={ports.grpc}",
            f"--metrics-address={BACKEND_ADDRESS}", f"--metrics-port={ports.metrics}", *extra_args]


def connect(docker_host: str | None = None, timeout_s: int = 120) -> docker.DockerClient:
    """A client for ``docker_host`` (None: DOCKER_HOST or the local socket) that answered a ping."""
    where = docker_host or "the default socket (DOCKER_HOST or /var/run/docker.sock)"
    try:
        client = (docker.DockerClient(base_url=docker_host, timeout=timeout_s) if docker_host
                  else docker.from_env(timeout=timeout_s))
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        raise DockerUnavailable(f"no Docker daemon answers at {where}: {one_line(err)}") from err
    return client


def missing_image_fix(image: str) -> str:
    """How a user gets ``image``: NVIDIA's serving images come from NGC (a login with an NGC API key, then a
    pull: NGC's docs, "Accessing and pulling an NGC container image"); stoker's own are built by `stoker image`."""
    if image.split("/", 1)[0] == "nvcr.io":
        return (f"pull it: `docker login nvcr.io` (username $oauthtoken, an NGC API key as password), then "
                f"`docker pull {image}`")
    return "build it with `stoker image`"


def require_image(client: docker.DockerClient, image: str) -> None:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ImageMissing(f"image {image} is not in the Docker daemon; {missing_image_fix(image)}") from None
    except requests.exceptions.ConnectionError as err:
        raise DockerUnavailable(f"Docker daemon stopped answering: {one_line(err)}") from err


def containers(client: docker.DockerClient, name: str | None = None, role: str | None = None) -> list[Container]:
    """Managed containers (any state) of deployment ``name`` (None: all), newest first."""
    labels = [f"{LABEL_MANAGED}=true"]
    if name:
        labels.append(f"{LABEL_DEPLOYMENT}={name}")
    # ignore_removed: the SDK lists ids, then inspects each; a container removed in between (a retire, another
    # deployment's `stoker down`) is gone, not an error (seen: `stoker status` failing with "No such container").
    found = client.containers.list(all=True, filters={"label": labels}, ignore_removed=True)
    if role:
        # Wave-1 containers carry no role: they were backends that owned the spec's ports.
        found = [c for c in found if c.labels.get(LABEL_ROLE, ROLE_BACKEND) == role]
    return sorted(found, key=created_key, reverse=True)


def created_key(c: Container) -> tuple[str, int]:
    # Docker trims trailing zeros of the nanoseconds, so compare the fraction as a number.
    created = str(c.attrs.get("Created", ""))
    whole, _, frac = created.rstrip("Z").partition(".")
    return whole, int(frac.ljust(9, "0")[:9] or 0)


def backend_name(deployment: str, slot: str, replica: int = 0) -> str:
    return f"stoker-{deployment}-{slot}" + (f"-{replica}" if replica else "")


def proxy_name(deployment: str) -> str:
    return f"stoker-{deployment}-proxy"


def openai_name(deployment: str) -> str:
    return f"stoker-{deployment}-openai"


# Triton itself refuses its admin APIs (model control and the repository index, statistics, trace, logging, shared
# memory) to any request without this header and the backend's own token: the proxy refuses them at the public
# address, and this covers a backend's own loopback ports. The token is made per backend. Triton takes it only as an
# argument, which every local user reads in /proc/PID/cmdline: the argument carries argv_secret.PLACEHOLDER, the
# container's environment the token, and the argv_secret shim (LD_PRELOAD) swaps it in inside each tritonserver
# process. What still holds it: the container's Config.Env (Docker's inspect, root-equivalent) and the environment of
# the container's init (/proc/PID/environ: owner and root only). stoker's reload path reads it back (admin_headers).
ADMIN_HEADER = "stoker-admin"
RESTRICTED_APIS = "model-repository,statistics,trace,logging,shared-memory"
_RESTRICTED_PREFIX = f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}="


def restricted_args(token: str = argv_secret.PLACEHOLDER) -> list[str]:
    return [f"{_RESTRICTED_PREFIX}{token}", f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_HEADER}={token}"]


def placeholder_header() -> dict[str, str]:
    """The admin header with the token's placeholder: what a backend whose shim did not load would take as its key."""
    return {ADMIN_HEADER: argv_secret.PLACEHOLDER}


def admin_headers(container: Container) -> dict[str, str]:
    """The header that opens ``container``'s admin APIs ({} for a backend started before they were restricted):
    the token from its environment, or from its arguments for a backend started by an older stoker."""
    for pair in (container.attrs.get("Config") or {}).get("Env") or []:
        name, _, value = pair.partition("=")
        if name == argv_secret.VARIABLE and value:
            return {ADMIN_HEADER: value}
    for arg in container.attrs.get("Args") or []:
        if arg.startswith(_RESTRICTED_PREFIX) and arg != f"{_RESTRICTED_PREFIX}{argv_secret.PLACEHOLDER}":
            return {ADMIN_HEADER: arg[len(_RESTRICTED_PREFIX):]}
    return {}


def backend_command(spec: BackendSpec, ports: Ports) -> list[str]:
    """The backend's command on ``ports``: the target's serve command, or tritonserver's, each with Triton's admin
    APIs restricted to the header carrying the token's placeholder (every tritonserver process of it). Pure."""
    extra = [*spec.extra_args, *restricted_args()]
    return spec.command(ports, extra) if spec.command else triton_args(spec.repository_uri, ports, extra)


def start_backend(client: docker.DockerClient, spec: BackendSpec, slot: str, ports: Ports, replica: int = 0) -> Container:
    """Run Triton for ``spec`` in ``slot`` (its replica ``replica``) on ``ports``. No restart policy until promoted.
    Raises argv_secret.ShimUnavailable (one line, before any container exists) when the shim cannot be built."""
    shim = argv_secret.build()
    labels = {**spec.labels, LABEL_MANAGED: "true", LABEL_DEPLOYMENT: spec.name, LABEL_ROLE: ROLE_BACKEND,
              LABEL_DIGEST: spec.repo_digest, LABEL_SLOT: slot, LABEL_PORTS: ports.label(), LABEL_RUN: spec.run_id,
              LABEL_INTERFACE: spec.interface,
              **({LABEL_REPLICA: str(replica)} if replica else {})}
    if spec.admit is not None:
        labels |= spec.admit(client)
    kwargs: dict = {}
    if spec.entrypoint is not None:
        kwargs["entrypoint"] = spec.entrypoint
    if spec.mounts:
        kwargs["volumes"] = {host: {"bind": inside, "mode": "ro"} for host, inside in spec.mounts.items()}
    if spec.device_ids:
        kwargs["device_requests"] = [DeviceRequest(device_ids=[str(i) for i in spec.device_ids],
                                                   capabilities=[["gpu"]])]
    # Created, given the shim (Docker's archive API: any image, a remote engine too), then started.
    return _run(client, spec.image, backend_command(spec, ports),
                name=backend_name(spec.name, slot, replica), labels=labels,
                environment={**spec.env, **argv_secret.environment(secrets.token_hex(16))},
                shm_size=spec.shm_size,
                ulimits=[Ulimit(name=k, soft=s, hard=h) for k, (s, h) in spec.ulimits.items()],
                files=(str(Path(argv_secret.CONTAINER_DIR).parent), argv_secret.archive(shim)), **kwargs)


def start_proxy(client: docker.DockerClient, deployment: str, image: str, listen: Ports, state_dir: Path,
                mount: str, config: str, address: str = BACKEND_ADDRESS, front: str = "open") -> Container:
    """Run the deployment's proxy: restarted by Docker (also after a daemon restart) unless stoker stops it."""
    labels = {LABEL_MANAGED: "true", LABEL_DEPLOYMENT: deployment, LABEL_ROLE: ROLE_PROXY,
              LABEL_PORTS: listen.label(), LABEL_ADDRESS: address, LABEL_FRONT: front}
    return _run(client, image, ["-db", "-f", f"{mount}/{config}"], name=proxy_name(deployment), labels=labels,
                entrypoint=["haproxy"], volumes={str(state_dir): {"bind": mount, "mode": "rw"}},
                restart_policy={"Name": "unless-stopped"}, log_config=LOG_CONFIG)


def front_name(fleet: str) -> str:
    return f"stoker-{fleet}-front"


def start_front(client: docker.DockerClient, fleet: str, image: str, state_dir: Path, mount: str,
                config: str) -> Container:
    """Run a fleet's front HAProxy on this engine (host network), restarted by Docker unless stoker stops it."""
    labels = {LABEL_MANAGED: "true", LABEL_FLEET: fleet, LABEL_ROLE: ROLE_FRONT}
    return _run(client, image, ["-db", "-f", f"{mount}/{config}"], name=front_name(fleet), labels=labels,
                entrypoint=["haproxy"], volumes={str(state_dir): {"bind": mount, "mode": "rw"}},
                restart_policy={"Name": "unless-stopped"}, log_config=LOG_CONFIG)


def start_openai(client: docker.DockerClient, deployment: str, image: str, state_dir: Path, mount: str,
                 command: list[str], env: dict[str, str], labels: dict[str, str]) -> Container:
    """Run the deployment's OpenAI-compatible API (the image's Python): restarted by Docker, as the proxy."""
    labels = {**labels, LABEL_MANAGED: "true", LABEL_DEPLOYMENT: deployment, LABEL_ROLE: ROLE_OPENAI}
    return _run(client, image, command, name=openai_name(deployment), labels=labels,
                entrypoint=["/opt/venv/bin/python"], environment=env,
                volumes={str(state_dir): {"bind": mount, "mode": "rw"}},
                restart_policy={"Name": "unless-stopped"}, log_config=LOG_CONFIG)


def _run(client: docker.DockerClient, image: str, command: list[str], *, name: str,
         files: tuple[str, bytes] | None = None, **kwargs) -> Container:
    """Create and start a container; ``files``: (folder, tar) extracted into it before it starts."""
    try:
        # init: as PID 1, HAProxy and Python ignore SIGTERM, so every stop waited out STOP_TIMEOUT_S for its SIGKILL;
        # Docker's init forwards the signal and they exit at once.
        if files is None:
            return client.containers.run(image, command, name=name, detach=True, network_mode="host", init=True,
                                         **kwargs)
        container = client.containers.create(image, command, name=name, detach=True, network_mode="host", init=True,
                                             **kwargs)
        if not container.put_archive(*files):
            raise docker.errors.APIError(f"could not copy files into {name} at {files[0]}")
        container.start()
        return container
    except docker.errors.APIError as err:
        # Created but failed to start (e.g. a refused rlimit): do not leave it behind.
        try:
            client.containers.get(name).remove(force=True)
        except docker.errors.DockerException:
            pass
        raise NotReady(f"{name} failed to start: {one_line(err)}") from None
    except requests.exceptions.ConnectionError as err:
        raise DockerUnavailable(f"Docker daemon stopped answering: {one_line(err)}") from err


def keep_running(c: Container) -> None:
    """A promoted backend comes back on its own after a crash or a daemon restart."""
    c.update(restart_policy={"Name": "unless-stopped"})


def state_mount(c: Container, mount: str) -> Path | None:
    """The host folder bind-mounted at ``mount`` in ``c`` (the proxy's state folder)."""
    for m in c.attrs.get("Mounts") or []:
        if m.get("Destination") == mount and m.get("Source"):
            return Path(m["Source"])
    return None


def exit_reason(c: Container) -> str | None:
    """None while ``c`` runs as started; else why it does not (exited, removed, restarted)."""
    try:
        c.reload()
    except docker.errors.NotFound:
        return "container was removed"
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        return f"Docker daemon did not answer ({one_line(err)})"
    state = c.attrs.get("State") or {}
    if c.status in ("exited", "dead", "restarting") or state.get("Restarting"):
        return f"status {c.status}, exit code {state.get('ExitCode')}"
    if int(c.attrs.get("RestartCount") or 0) > 0:
        return f"restarted {c.attrs['RestartCount']} time(s)"
    return None


def started_at(c: Container) -> str:
    return str((c.attrs.get("State") or {}).get("StartedAt", ""))


def log_tail(c: Container, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = c.logs(tail=10 * lines).decode("utf-8", "replace")
    except (docker.errors.DockerException, requests.exceptions.RequestException):
        return "(logs unavailable)"
    # Triton prints wide status tables last; they would push the load error out of the tail.
    kept = [ln for ln in text.splitlines() if ln.strip() and ln.lstrip()[:1] not in ("|", "+")]
    return "\n".join(kept[-lines:]) or "(no output)"


def stop_and_remove(c: Container, log: Log, timeout_s: int = STOP_TIMEOUT_S) -> None:
    """Stop gracefully with a deadline, then kill: one SIGTERM to Triton has hung for minutes."""
    try:
        c.reload()
        if c.status in ("running", "restarting"):
            c.stop(timeout=timeout_s)  # the daemon sends SIGKILL after timeout_s
    except docker.errors.NotFound:
        return
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        log(f"stop of {c.name} failed ({one_line(err)}); killing it")
    try:
        c.remove(force=True)  # force: SIGKILL if anything survived the stop
    except docker.errors.NotFound:
        pass
    except (docker.errors.DockerException, requests.exceptions.RequestException) as err:
        # The daemon is gone (restarting): keep the error that brought us here; the next deploy's
        # reconcile removes what is left.
        log(f"could not remove {c.name} ({one_line(err)}); the next deploy removes it")


def remove_deployment(client: docker.DockerClient, name: str, log: Log) -> list[str]:
    """Stop and remove every container of deployment ``name`` (backends and proxy); returns their names."""
    removed = []
    # The proxy first: it stops taking traffic, and the streams it holds open to the backends close with it; a
    # backend with an open stream waits Triton's exit timeout (30 s; our stop's 10 s SIGKILL comes first).
    for c in sorted(containers(client, name), key=lambda c: c.name != proxy_name(name)):
        log(f"removing {c.name}")
        stop_and_remove(c, log)
        removed.append(c.name)
    return removed


def one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


class LogPump:
    """Streams a container's output to ``log`` from a daemon thread until stopped: the lines ``keep``
    accepts (default all); the container's own log keeps every line."""

    def __init__(self, container: Container, log: Log, prefix: str, keep: Callable[[str], bool] | None = None) -> None:
        self._container, self._log, self._prefix = container, log, prefix
        self._keep = keep or (lambda _line: True)
        self._stream = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"logs{prefix}", daemon=True)
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
                for raw in lines:
                    line = raw.decode("utf-8", "replace").rstrip()
                    if self._keep(line):
                        self._log(f"{self._prefix} {line}")
        # Closing the stream from stop() surfaces here as whatever the transport raises; all mean "done".
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
