"""The tokenizer a stoker deployment serves, found from its address (`stoker bench` counts tokens with it).

A port of a deployment's stable endpoint (its proxy) names the live backend; a backend's own port names
that backend. Its run id names the run's manifest, whose package step lists the repository's
tokenizer.json (used when the file is here with its recorded sha256). Without that (another
STOKER_HOME, another machine), the file is read from the repository in S3 that the backend loaded,
with this environment's AWS credentials, and kept under $STOKER_HOME/cache/bench-tokenizer/<digest>/.
Only the local Docker daemon is asked: an address on another host finds nothing.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlparse

from .backend_repo import repository_of, s3_client
from ..containers import engine
from ..bench.counting import Found
from ..storage.digest import file_sha256
from ..atomic import write_atomic
from ..openai_api.layout import TOKENIZER_HOMES, NoTokenizer, tokenizer_folder
from . import promote
from ..containers.ports import Ports

_LOCAL = {"127.0.0.1", "localhost", "::1", "0.0.0.0", ""}


def address(url: str) -> tuple[str, int | None]:
    """(host, port) of `host:port`, `http://host:port` or `https://…`; port None when there is none."""
    parsed = urlparse(url if "://" in url else f"grpc://{url}")
    try:
        return parsed.hostname or "", parsed.port
    except ValueError:
        return parsed.hostname or "", None


def is_local(host: str) -> bool:
    return host in _LOCAL or host.startswith("127.") or host in (socket.gethostname(), socket.getfqdn())


def lookup(url: str, home: Path) -> Found:
    """The tokenizer.json of the deployment serving `url`, or why there is none (`Found.source`)."""
    host, port = address(url)
    if port is None:
        return Found(None, f"{url} names no port")
    if not is_local(host):
        return Found(None, f"{host} is not this machine, and only this machine's Docker daemon is asked")
    try:
        client = engine.connect(None, timeout_s=10)
    except engine.DockerUnavailable:
        return Found(None, "no Docker daemon answers here to say which deployment serves it")
    backend, via = _backend_on(client, port, home)
    if backend is None:
        return Found(None, via)
    run_id = backend.labels.get(engine.LABEL_RUN, "")
    where = f"deployment {backend.labels.get(engine.LABEL_DEPLOYMENT, '?')} ({via}, run {run_id or '?'})"
    manifest = home / "runs" / run_id / "manifest.json" if run_id else None
    if manifest is not None and manifest.is_file():
        path = _from_manifest(json.loads(manifest.read_text()))
        if path is not None:
            return Found(path, f"{where}, from its manifest")
    return _from_s3(backend, home, where)


def interface_on(url: str, home: Path) -> str | None:
    """The serving interface (stoker.protocol layout) of the deployment serving `url`, when this machine's Docker
    daemon runs it; None when it cannot tell."""
    host, port = address(url)
    if port is None or not is_local(host):
        return None
    try:
        client = engine.connect(None, timeout_s=10)
    except engine.DockerUnavailable:
        return None
    backend, _ = _backend_on(client, port, home)
    return None if backend is None else backend.labels.get(engine.LABEL_INTERFACE, "ensemble")


def _backend_on(client, port: int, home: Path):
    """(the backend container serving `port`, how it was reached), or (None, why not)."""
    for c in engine.containers(client):
        try:
            ports = Ports.parse(c.labels[engine.LABEL_PORTS])
        except (KeyError, ValueError):
            continue
        if port not in ports.values():
            continue
        name = c.labels.get(engine.LABEL_DEPLOYMENT, "")
        role = c.labels.get(engine.LABEL_ROLE, engine.ROLE_BACKEND)  # wave-1 backends carry no role
        if role == engine.ROLE_BACKEND:
            return c, f"backend {c.name}"
        if role != engine.ROLE_PROXY:
            continue
        view, _ = promote.observe_proxy(client, promote.Target(name, ports, "", home / "proxy" / name))
        if not view.running or view.live is None:
            return None, f"deployment {name}'s proxy on port {port} routes to no backend"
        for b in engine.containers(client, name, role=engine.ROLE_BACKEND):
            if b.labels.get(engine.LABEL_SLOT) == view.live and b.status == "running":
                return b, f"live backend {b.name} behind port {port}"
        return None, f"deployment {name}'s live slot {view.live} has no running backend"
    return None, f"no stoker deployment on this machine's Docker daemon serves port {port}"


def _from_manifest(manifest: dict) -> Path | None:
    """The repository's tokenizer.json as the package step recorded it (where its layout keeps it: layout.py), if it
    is still here unchanged."""
    recorded: dict[str, tuple[Path, str | None]] = {}
    for out in (manifest.get("steps", {}).get("package") or {}).get("outputs") or []:
        uri = str(out.get("uri", ""))
        if not uri.startswith("file://"):
            continue
        parts = Path(urlparse(uri).path).parts
        for i, part in enumerate(parts):  # the key relative to the repository's root
            if part in TOKENIZER_HOMES:
                recorded["/".join(parts[i:])] = (Path(urlparse(uri).path), out.get("sha256"))
    try:
        _version, folder = tokenizer_folder(recorded)
    except NoTokenizer:
        return None
    path, sha = recorded[f"{folder}/tokenizer.json"]
    return path if path.is_file() and file_sha256(path) == sha else None


def _from_s3(backend, home: Path, where: str) -> Found:
    repo = repository_of(backend)
    if repo is None:
        return Found(None, f"{where}: no manifest here and no S3 model repository in its arguments")
    digest = backend.labels.get(engine.LABEL_DIGEST, "") or "unknown"
    cached = home / "cache" / "bench-tokenizer" / digest[:24] / "tokenizer.json"
    if digest != "unknown" and cached.is_file():
        return Found(cached, f"{where}, from its repository in S3 (kept in {cached.parent})")
    _endpoint, bucket, key = repo
    try:  # with the backend's own credentials, as Triton reads it
        s3 = s3_client(backend, repo)
        keys = [o["Key"][len(key) + 1:] for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{key}/") for o in page.get("Contents", [])]
        _version, folder = tokenizer_folder(keys)
        rel = f"{folder}/tokenizer.json"
        body = s3.get_object(Bucket=bucket, Key=f"{key}/{rel}")["Body"].read()
    except Exception as err:  # noqa: BLE001 - any failure means "not found"; the cause goes in the message
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return Found(None, f"{where}: no manifest here, and no tokenizer.json could be read from s3://{bucket}/{key}/ "
                           f"({type(err).__name__}: {first})")
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cached, body.decode("utf-8"))
    return Found(cached, f"{where}, from its repository in S3 ({rel})")
