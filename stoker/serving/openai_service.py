"""The deployment's OpenAI-compatible API: its container, and the live build's tokenizer files it reads.

One service per deployment (``stoker-<name>-openai``, the Triton CPU image's Python, host network,
restart policy ``unless-stopped``, like the proxy), running ``stoker.openai_api`` copied into the
deployment's state folder. The proxy sends ``/v1/`` on the stable HTTP port to it over a unix
socket in that folder; the service reaches Triton through the proxy's gRPC frontend, bound a second time
on a unix socket in the same folder, so its requests go wherever the proxy routes, like any client's. What the service needs from the live
build, its tokenizer files, stoker writes beside it at each switch:

    <state>/openai/app/<code digest>/stoker_openai/   the service's code
    <state>/openai/assets/<content key>/              a build's tokenizer files (tensorrt_llm/<v>/weights/)
    <state>/openai/backends/<container id>.json       which assets a backend container serves
    <state>/openai/live.json                          the live one and its backend's interface (ensemble or
                                                      llmapi); the service re-reads it when it changes

The files come from the model repository in S3 that the backend loaded (its ``--model-repository``,
with its own credentials), fetched when a candidate is proven (``prefetch``) so that the switch
itself only rewrites live.json (``follow``); in reload mode, after every in-place load.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import docker
import docker.errors

from .backend_repo import mounted_repository, repository_of, s3_client
from ..containers import engine
from ..atomic import write_atomic
from ..openai_api.layout import ADAPTERS_TABLE, ASSET_FILES, LIMITS_FILE, LIVE_FILE, NoTokenizer, tokenizer_folder
from ..triton.config import MODEL_NAME
from . import haproxy

Log = Callable[[str], None]
FOLDER = "openai"
SOCKET = "api.sock"
GRPC_SOCKET = "grpc.sock"  # the proxy's gRPC frontend, bound in this folder too: cleartext, never TCP, never TLS
PACKAGE = "stoker_openai"  # the name stoker.openai_api has inside the container
LABEL_CONFIG = "ai.stoker.openai-config"
_CODE = Path(__file__).resolve().parent.parent / "openai_api"
START_TIMEOUT_S = 30.0


class OpenAIServiceError(engine.DeployError):
    """The OpenAI service did not start, or the live build's tokenizer files could not be fetched."""


def socket_path(mount: str = haproxy.MOUNT) -> str:
    """Where the service listens, as the proxy and the service (both mounting the state folder) see it."""
    return f"{mount}/{FOLDER}/{SOCKET}"


def grpc_socket_path(mount: str = haproxy.MOUNT) -> str:
    """Where the proxy's gRPC frontend also listens for the service (both see it at this path)."""
    return f"{mount}/{FOLDER}/{GRPC_SOCKET}"


def code_digest() -> str:
    h = hashlib.sha256()
    for f in sorted(_CODE.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def command(name: str, mount: str = haproxy.MOUNT) -> list[str]:
    """The service's arguments to the image's Python. Pure.

    It reaches Triton through the proxy (so it follows every switch), over the proxy's gRPC frontend bound on a
    unix socket in its own folder: the same key checks as the public port, and no TLS to speak when the public
    port has it."""
    return ["-m", PACKAGE, "--model", name, "--grpc", f"unix:{grpc_socket_path(mount)}", "--state",
            f"{mount}/{FOLDER}", "--uds", socket_path(mount)]


# What the service's container mounts: its own folder only. The proxy's state folder around it holds HAProxy's
# admin socket, which must stay out of reach of the process that parses public requests. Part of the config key,
# so a service started with the whole folder mounted is replaced.
MOUNTS = "own-folder"


def config_key(image: str, args: list[str], code: str) -> str:
    """What the running service must match; anything else recreates it. Pure."""
    return hashlib.sha256(json.dumps([image, args, code, MOUNTS]).encode()).hexdigest()[:24]


def _install_code(state: Path, code: str) -> str:
    """Copy the service's package into the state folder (once per code digest); returns its PYTHONPATH entry."""
    app = state / "app" / code[:16]
    if not (app / PACKAGE).is_dir():
        tmp = Path(tempfile.mkdtemp(dir=state, prefix=".app-"))
        shutil.copytree(_CODE, tmp / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        app.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(app)
        except OSError:  # another process installed it first
            shutil.rmtree(tmp, ignore_errors=True)
    return f"{haproxy.MOUNT}/{FOLDER}/app/{code[:16]}"


def container(client: docker.DockerClient, name: str):
    found = engine.containers(client, name, role=engine.ROLE_OPENAI)
    return found[0] if found else None


def ensure(client: docker.DockerClient, name: str, image: str, state_dir: Path, log: Log):
    """Make the deployment's OpenAI service run with this code, image and address; returns its container.

    Idempotent: a running service with the same configuration is left alone (its clients never notice).
    """
    state = state_dir / FOLDER
    state.mkdir(parents=True, exist_ok=True)
    code = code_digest()
    args = command(name)
    want = config_key(image, args, code)
    c = container(client, name)
    if c is not None and c.labels.get(LABEL_CONFIG) == want:
        if c.status == "running":
            return c
        try:
            c.start()
            return c
        except docker.errors.APIError:
            pass
    if c is not None:
        log(f"replacing {c.name} (its code, image or address changed)" if c.status == "running"
            else f"replacing {c.name} ({c.status})")
        engine.stop_and_remove(c, log)
    engine.require_image(client, image)
    pythonpath = _install_code(state, code)
    (state / SOCKET).unlink(missing_ok=True)
    log(f"starting {engine.openai_name(name)} ({image}): the OpenAI API at /v1/ of the stable HTTP port")
    c = engine.start_openai(client, name, image, state, f"{haproxy.MOUNT}/{FOLDER}", args,
                            env={"PYTHONPATH": pythonpath, "PYTHONDONTWRITEBYTECODE": "1"},
                            labels={LABEL_CONFIG: want})
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (state / SOCKET).exists():
        reason = engine.exit_reason(c)
        if reason or time.monotonic() > deadline:
            raise OpenAIServiceError(f"{c.name} did not start ({reason or f'no socket after {START_TIMEOUT_S:g} s'}): "
                                     f"{engine.log_tail(c, 3).splitlines()[-1:]}")
        time.sleep(0.1)
    return c


def remove(client: docker.DockerClient, name: str, log: Log) -> None:
    c = container(client, name)
    if c is not None:
        log(f"removing {c.name} (no OpenAI API for this deployment)")
        engine.stop_and_remove(c, log)


# ---------------------------------------------------------------- the live build's tokenizer files


def pick_assets(listing: dict[str, tuple[str, int]]) -> tuple[int, dict[str, str]]:
    """From the objects of a model repository (key relative to its root → (etag, size)): the engine model's newest
    version, and the asset files the service reads (name → relative key): the tokenizer's folder (layout.py says
    where each layout keeps it), the deployed limits and the adapters table of that version. Pure."""
    try:
        version, folder = tokenizer_folder(listing)
    except NoTokenizer as err:
        raise OpenAIServiceError(str(err)) from None
    files = {name: f"{folder}/{name}" for name in ASSET_FILES if f"{folder}/{name}" in listing}
    for rel in (LIMITS_FILE, ADAPTERS_TABLE):  # the build's limits; the LoRA adapters it serves, by name
        if f"{MODEL_NAME}/{version}/{rel}" in listing:
            files[Path(rel).name] = f"{MODEL_NAME}/{version}/{rel}"
    return version, files


def fetch_assets(c, state: Path) -> dict:
    """The tokenizer files of the build backend container ``c`` serves, under ``state/assets/<content key>``.

    Read from the S3 repository in its ``--model-repository`` with its own credentials; the key covers the
    files' ETags and sizes, so an unchanged build is never fetched twice.
    """
    repo = repository_of(c)
    if repo is None:
        mounted = mounted_repository(c)
        if mounted is None:
            raise OpenAIServiceError(f"{c.name} serves no model repository in S3 or from a mounted folder")
        return _copy_mounted(c, mounted, state)
    _endpoint, bucket, key = repo
    s3 = s3_client(c, repo)
    base = f"{key}/"
    listing = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
        for o in page.get("Contents", []):
            listing[o["Key"][len(base):]] = (o.get("ETag", ""), o.get("Size", 0))
    version, files = pick_assets(listing)
    content = _store(state, listing, files, lambda rel: s3.get_object(Bucket=bucket, Key=base + rel)["Body"].read())
    digest = c.labels.get(engine.LABEL_DIGEST, "")
    return {"assets": f"assets/{content}", "digest": content if not digest or digest.startswith("live-") else digest,
            "repository": f"s3://{bucket}/{key}", "version": version}


def _copy_mounted(c, root: Path, state: Path) -> dict:
    """fetch_assets for a repository mounted from a folder of this host (GPU targets): the same files, copied."""
    base = root
    listing = {p.relative_to(base).as_posix(): (f"{p.stat().st_mtime_ns}", p.stat().st_size)
               for p in base.rglob("*") if p.is_file() and (p.name in ASSET_FILES or p.name == LIMITS_FILE or
                                                             p.relative_to(base).as_posix().endswith(ADAPTERS_TABLE))}
    version, files = pick_assets(listing)
    content = _store(state, listing, files, lambda rel: (base / rel).read_bytes())
    return {"assets": f"assets/{content}", "digest": c.labels.get(engine.LABEL_DIGEST, "") or content,
            "repository": str(root), "version": version}


def _store(state: Path, listing: dict, files: dict[str, str], read) -> str:
    """The asset files under state/assets/<content key> (written once, atomically: a temp folder renamed)."""
    content = hashlib.sha256(json.dumps(sorted((n, *listing[k]) for n, k in files.items())).encode()).hexdigest()[:24]
    dest = state / "assets" / content
    if not dest.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".fetch-"))
        try:
            for name, rel in files.items():
                (tmp / name).write_bytes(read(rel))
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return content


def _index(state: Path, c) -> Path:
    return state / "backends" / f"{c.id[:24]}.json"


def prefetch(state_dir: Path, c, log: Log) -> None:
    """Fetch the tokenizer files of a proven candidate, so that the switch only names them. Best effort."""
    state = state_dir / FOLDER
    try:
        entry = fetch_assets(c, state)
    except Exception as err:  # noqa: BLE001 - the switch fetches again, and says so if it fails
        log(f"OpenAI API: the tokenizer files of {c.name} were not fetched yet ({engine.one_line(err)})")
        return
    write_atomic(_index(state, c), json.dumps(entry))


def follow(client: docker.DockerClient, state_dir: Path, backend: str, log: Log, refresh: bool = False) -> None:
    """Point the OpenAI service at the build ``backend`` serves (live.json); ``refresh``: it loaded a new version.

    Never raises: the switch has happened. When the files cannot be had, live.json says why, and the
    service answers 503 with that cause rather than tokenizing for another build.
    """
    state = state_dir / FOLDER
    if not state.is_dir():
        return
    try:
        c = client.containers.get(backend)
        index = _index(state, c)
        if not refresh and index.is_file():
            entry = json.loads(index.read_text())
        else:
            entry = fetch_assets(c, state)
            write_atomic(index, json.dumps(entry))
        # How the service speaks to this backend (stoker.protocol's layout, the label start_backend sets; a backend
        # started before the label existed served the ensemble): the service follows it with the tokenizer.
        live = {**entry, "interface": c.labels.get(engine.LABEL_INTERFACE) or "ensemble", "backend": backend}
    except Exception as err:  # noqa: BLE001 - any cause; it goes into live.json and the log
        live = {"error": f"the tokenizer files of {backend} could not be fetched: {engine.one_line(err)}",
                "backend": backend}
        log(f"OpenAI API: {live['error']}; /v1/ answers 503 until the next switch")
    write_atomic(state / LIVE_FILE, json.dumps(live))
