"""A deployment as it stands: its stable endpoint (Target), its backends as Docker labels them, its proxy as HAProxy
reports it, and the proxy's config file kept in step with them. What promote.py's steps read and rewrite.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import docker

from ..containers import engine
from ..errors import StepError, StokerError
from ..atomic import write_atomic
from . import api_keys, edge, haproxy, openai_service, probe, topology
from ..containers.ports import Ports

Log = Callable[[str], None]


TLS_NAME = "tls.pem"  # the certificate and its key, as the proxy reads them (its state folder, mode 600)


class PromotionFailed(StokerError):
    """The candidate did not go live, or was switched back; the message names the cause. ``status``: what the
    endpoint serves afterwards, for the run's record ("rolled back": the old build again; "kept": the new build,
    the old one being dead; "nothing serves")."""

    def __init__(self, message: str, status: str = "rolled back") -> None:
        super().__init__(message)
        self.status = status


class TlsError(StepError):
    """deploy.tls names a file that cannot be read or is not PEM."""


@dataclass(frozen=True)
class Target:
    """One deployment's stable side: its name, the ports clients use, the proxy image, the state folder;
    ``openai_image`` runs its OpenAI-compatible API behind the proxy's /v1/ ("" for none)."""

    name: str
    listen: Ports
    proxy_image: str
    state_dir: Path
    openai_image: str = ""
    address: str = engine.BACKEND_ADDRESS  # where the stable endpoint binds (deploy.listen); loopback by default
    keys: api_keys.KeySet | None = None  # the API keys' digests the proxy asks for (deploy.api_keys)
    tls: tuple[Path, Path] | None = None  # certificate and key files (deploy.tls)
    # The backends host Triton's own OpenAI frontend on their metrics-role port (a GPU target's, by contract):
    # the proxy's metrics frontend then routes /v1/ too.
    openai_on_metrics: bool = False
    replicas: int = 1  # deploy.replicas: backends per slot behind the proxy
    limits: edge.EdgeLimits = edge.EdgeLimits()  # deploy.limits: what one client and all may ask (edge.py)

    @property
    def endpoint(self) -> dict:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "::", "127.0.0.1") else self.address
        scheme = "https" if self.tls else "http"
        out = {"http": f"{scheme}://{host}:{self.listen.http}", "grpc": f"{host}:{self.listen.grpc}",
               "metrics": f"{scheme}://{host}:{self.listen.metrics}/metrics"}
        if self.openai_image:
            out["openai"] = f"{scheme}://{host}:{self.listen.http}/v1"
        elif self.openai_on_metrics:
            out["openai"] = f"{scheme}://{host}:{self.listen.metrics}/v1"
        return out

    def tls_pem(self) -> str | None:
        """The certificate and key as one PEM, as HAProxy reads them; None without TLS."""
        if self.tls is None:
            return None
        parts = []
        for what, path in zip(("certificate", "key"), self.tls):
            try:
                text = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as err:
                raise TlsError(f"deploy.tls: cannot read the {what} {path}: {getattr(err, 'strerror', None) or err}"
                               ) from None
            if "-----BEGIN " not in text:
                raise TlsError(f"deploy.tls: the {what} {path} is not PEM")
            parts.append(text if text.endswith("\n") else text + "\n")
        _check_pair(*self.tls)
        return "".join(parts)

    @staticmethod
    def asks(front: str) -> str:
        """What a proxy with label ``front`` asks of clients, in words (stoker status). Pure."""
        parts = set(front.split(","))
        asked = [*(["an API key"] if "keys" in parts else []),
                 *(["TLS"] if any(p.startswith("tls:") for p in parts) else [])]
        return " and ".join(asked) or "nothing (no API key)"

    @property
    def front(self) -> str:
        """How the proxy's frontends bind and what they ask of clients (its label; a change recreates the proxy):
        open, or keys, openai-uds, tls:<digest> joined by commas."""
        parts = ["keys"] if self.keys else []
        if self.openai_image:
            parts.append("openai-uds")  # the gRPC frontend's second bind, for the OpenAI service
        if self.openai_on_metrics:
            parts.append("openai-metrics")
        if self.replicas > 1:
            parts.append(f"replicas:{self.replicas}")  # its server lines per slot: HAProxy reads them at start
        if self.limits.changed():  # HAProxy reads its bounds at start: other bounds, another proxy
            parts.append("limits:" + hashlib.sha256(json.dumps(self.limits.changed(), sort_keys=True).encode()
                                                    ).hexdigest()[:12])
        pem = self.tls_pem()
        if pem is not None:
            parts.append("tls:" + hashlib.sha256(pem.encode()).hexdigest()[:16])
        return ",".join(parts) or "open"


@dataclass(frozen=True)
class BackendRef:
    """A backend as the flow passes it between steps (plain data: it travels through Prefect)."""

    container: str
    slot: str
    ports: tuple[int, int, int]
    digest: str
    run_id: str = ""
    # deploy.replicas: the siblings (replicas 1..N-1) as (container, ports); this one is replica 0
    replicas: tuple[tuple[str, tuple[int, int, int]], ...] = ()

    @property
    def p(self) -> Ports:
        return Ports(*self.ports)

    @property
    def all_ports(self) -> list[Ports]:
        """One Ports per replica, replica 0 first (what the proxy's slot servers point at)."""
        return [self.p, *(Ports(*ports) for _, ports in self.replicas)]

    def members(self) -> list[BackendRef]:
        """Every replica as a BackendRef of its own, replica 0 first."""
        return [self, *(BackendRef(c, self.slot, tuple(ports), self.digest, self.run_id) for c, ports in self.replicas)]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports[0]}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports[1]}"

    @property
    def metrics(self) -> str:
        return f"http://127.0.0.1:{self.ports[2]}/metrics"

    def to_dict(self) -> dict:
        return {**asdict(self), "http": self.http, "grpc": self.grpc, "metrics": self.metrics}

    @classmethod
    def from_dict(cls, d: dict | None) -> BackendRef | None:
        if not d:
            return None
        return cls(d["container"], d["slot"], tuple(d["ports"]), d["digest"], d.get("run_id", ""),
                   tuple((c, tuple(p)) for c, p in d.get("replicas", ())))

    @classmethod
    def of(cls, b: topology.Backend) -> BackendRef:
        return cls(b.container, b.slot, b.ports.values(), b.digest, b.run_id,
                   tuple((m.container, m.ports.values()) for m in b.members))


# ---------------------------------------------------------------- observe


def observe_backends(client: docker.DockerClient, name: str,
                     served: frozenset[str] = frozenset()) -> list[topology.Backend]:
    """The deployment's backends as Docker labels them; ``served``: the container ids the proxy has switched to
    (served_ids), which alone plan_repair may fall back to."""
    out = []
    for c in engine.containers(client, name, role=engine.ROLE_BACKEND):
        try:
            ports = Ports.parse(c.labels[engine.LABEL_PORTS])
        except (KeyError, ValueError):
            ports = Ports(0, 0, 0)
        running = c.status == "running"
        out.append(topology.Backend(
            container=c.name, slot=c.labels.get(engine.LABEL_SLOT, ""), ports=ports,
            digest=c.labels.get(engine.LABEL_DIGEST, ""), running=running,
            ready=running and probe.is_ready(f"http://127.0.0.1:{ports.http}", timeout_s=5.0, attempts=2),
            created=engine.created_key(c),
            run_id=c.labels.get(engine.LABEL_RUN, ""), legacy=engine.LABEL_ROLE not in c.labels,
            replica=int(c.labels.get(engine.LABEL_REPLICA, "0") or 0), served=c.id in served))
    return out


# ---------------------------------------------------------------- the backends that have served

SERVED_FILE = "served.json"  # in the proxy's state folder: container ids the proxy switched to, newest last
SERVED_KEEP = 64  # a few rollouts back (every replica); a container id is never reused


def served_ids(state_dir: Path) -> frozenset[str]:
    """The container ids the proxy of this state folder has switched to ({} when none is recorded)."""
    try:
        return frozenset(json.loads((Path(state_dir) / SERVED_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return frozenset()


def mark_served(state_dir: Path, ids: list[str]) -> None:
    """Record that the proxy now routes to ``ids``: having passed their gates, they may serve again after a crash."""
    path = Path(state_dir) / SERVED_FILE
    try:
        known = [i for i in json.loads(path.read_text()) if i not in ids]
    except (OSError, ValueError, TypeError):
        known = []
    write_atomic(path, json.dumps((known + list(ids))[-SERVED_KEEP:]))


def proxy_container(client: docker.DockerClient, name: str):
    found = engine.containers(client, name, role=engine.ROLE_PROXY)
    return found[0] if found else None


def runtime_for(target: Target, container=None) -> haproxy.Runtime:
    state_dir = (engine.state_mount(container, haproxy.MOUNT) if container is not None else None) or target.state_dir
    return haproxy.Runtime(state_dir, target.replicas)


def observe_proxy(client: docker.DockerClient, target: Target) -> tuple[topology.ProxyView, object]:
    c = proxy_container(client, target.name)
    if c is None:
        return topology.ProxyView(exists=False, running=False), None
    listen = None
    try:
        listen = Ports.parse(c.labels[engine.LABEL_PORTS])
    except (KeyError, ValueError):
        pass
    # A proxy started before deploy.listen existed bound every interface, and says nothing.
    address = c.labels.get(engine.LABEL_ADDRESS, "0.0.0.0")
    front = c.labels.get(engine.LABEL_FRONT, "open")  # older proxies asked nothing
    if c.status != "running":
        return topology.ProxyView(exists=True, running=False, listen=listen, address=address, front=front), c
    try:
        states = runtime_for(target, c).servers()
    except haproxy.ProxyApiError:
        return topology.ProxyView(exists=True, running=False, listen=listen, address=address, front=front), c
    http = {slot: st.port for slot, st in states.get("http", {}).items()}
    return topology.ProxyView(exists=True, running=True, live=haproxy.live_slot(states), http_ports=http,
                              listen=listen, openai=haproxy.OPENAI_BACKEND in states, address=address,
                              front=front), c


def routed_backend(client: docker.DockerClient, target: Target) -> topology.Backend | None:
    """The backend the deployment's proxy routes to now (topology.routes_to), or None."""
    view, _ = observe_proxy(client, target)
    return next((b for b in observe_backends(client, target.name) if topology.routes_to(view, b)), None)


def render_config(target: Target, slots: dict[str, Ports | None], live: str | None) -> str:
    return haproxy.render(haproxy.ProxyLayout(listen=target.listen, slots=slots, live=live,
                                              openai=openai_service.socket_path() if target.openai_image else None,
                                              openai_grpc=(openai_service.grpc_socket_path() if target.openai_image
                                                           else None),
                                              address=target.address, metrics_openai=target.openai_on_metrics,
                                              replicas=target.replicas, limits=target.limits,
                                              keys=keys_file() if target.keys else None,
                                              tls=f"{haproxy.MOUNT}/{TLS_NAME}" if target.tls else None))


def keys_file(mount: str = haproxy.MOUNT) -> str:
    return f"{mount}/{api_keys.DIGESTS_NAME}"


def write_front(target: Target) -> None:
    """What the proxy reads besides its config: the keys' digests and the TLS PEM (or neither), and the folder its
    gRPC frontend binds a socket in for the OpenAI service (HAProxy does not start when it cannot bind it)."""
    if target.openai_image:
        (target.state_dir / openai_service.FOLDER).mkdir(parents=True, exist_ok=True)
    api_keys.publish(target.state_dir, target.keys)
    pem = target.tls_pem()
    if pem is None:
        (target.state_dir / TLS_NAME).unlink(missing_ok=True)
    else:
        write_atomic(target.state_dir / TLS_NAME, pem)  # mode 600 (mkstemp)


def write_config(target: Target, slots: dict[str, Ports | None], live: str | None) -> None:
    """The proxy's file mirrors its runtime state, so a restarted proxy routes where the running one did."""
    target.state_dir.mkdir(parents=True, exist_ok=True)
    write_front(target)
    write_atomic(target.state_dir / haproxy.CONFIG_NAME, render_config(target, slots, live))


def sync_config(target: Target, slots: dict[str, Ports | None], live: str | None, log: Log) -> bool:
    """Make the config file say what the running proxy does (the runtime is the truth while it runs): a process
    cut between a runtime change and the file's rewrite left them apart, and a restart would route by the file.
    True when the file had to be rewritten."""
    write_front(target)  # the keys may have rotated: a restarted proxy reads the new list
    path = target.state_dir / haproxy.CONFIG_NAME
    expected = render_config(target, slots, live)
    if path.exists() and path.read_text() == expected:
        return False
    log(f"reconcile {target.name}: the proxy's config file disagreed with its running state; rewritten")
    target.state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, expected)
    return True


def _check_pair(cert: str | Path, key: str | Path) -> None:
    """TlsError (one line) when the certificate and key do not load as a pair: OpenSSL's own check, as HAProxy's
    would fail at start, so that a new proxy is never started (and the running one removed) on a bad pair."""
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key))
    except ssl.SSLError as err:
        why = "the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(err) else str(err.reason or err)
        raise TlsError(f"deploy.tls: {cert} and {key} do not load as a pair: {why}") from None
