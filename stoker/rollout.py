"""Rollout strategies for a Triton deployment, and the way back.

``replace``: a new container on the standby ports, health-gated, then the old one
removed (docker_engine.deploy; on failure the old one keeps serving).

``reload``: one long-lived container started with ``--model-control-mode=explicit``
serves a *live* repository in S3 (``<prefix>/live/<name>/model_repository``). A new
build is published into it as the next numeric version of every model, then loaded
through Triton's model-control API (``POST /v2/repository/models/M/load``). Triton
loads the new version next to the serving one and retires the old one only after
the load succeeded, so requests keep flowing: no restart, no port change.
``<prefix>/live/<name>/stoker-live.json`` records which digest each version holds,
so a rollback deletes the newest version and loads again (Triton falls back to the
previous one, still in S3).

Errors: ``RolloutError`` (one-line cause); a failed load first puts the previous
version back, so the endpoint keeps serving what it served before.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass

from botocore.exceptions import ClientError

from . import docker_engine, s3
from .errors import StokerError
from .spec import Spec, Storage
from .triton_config import ENSEMBLE_NAME, MODEL_NAME

Log = Callable[[str], None]
LIVE_STATE = "stoker-live.json"
LABEL_ROLLOUT = "ai.stoker.rollout"
# Composing models before the ensemble, so the ensemble's first request after its
# reload already meets the new versions.
LOAD_ORDER = ("preprocessing", MODEL_NAME, "postprocessing", ENSEMBLE_NAME)
EXPLICIT_ARGS = ["--model-control-mode=explicit", "--load-model=*"]


class RolloutError(StokerError):
    """A rollout or rollback failed; the message's first line is the cause."""


@dataclass(frozen=True)
class Serving:
    """What a deployment serves now: enough to return to it later."""

    strategy: str  # replace | reload
    container: str
    repository_uri: str
    digest: str  # the repository digest (reload: of the live version)
    image: str
    version: int | None = None  # reload: the live version number

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- pure parts


def live_prefix(storage: Storage, name: str) -> str:
    return f"{storage.prefix}/live/{name}"


def live_digest(storage: Storage, name: str) -> str:
    """A stable stand-in for the container's digest label: the reload container never changes repository."""
    return "live-" + hashlib.sha256(f"{storage.bucket}/{live_prefix(storage, name)}".encode()).hexdigest()[:40]


def version_key(src_key: str, src_root: str, dst_root: str, version: int) -> str | None:
    """Where an object of a built repository goes in the live one: ``M/1/rest`` → ``M/<version>/rest``.

    ``M/config.pbtxt`` keeps its place (returned unchanged under dst_root); anything else
    (a marker outside the model folders) is not part of the repository: None.
    """
    rel = src_key.removeprefix(src_root).lstrip("/")
    parts = rel.split("/")
    if len(parts) >= 2 and parts[1] == "config.pbtxt" and len(parts) == 2:
        return f"{dst_root}/{rel}"
    if len(parts) >= 3 and parts[1].isdigit():
        return f"{dst_root}/{parts[0]}/{version}/{'/'.join(parts[2:])}"
    return None


def request_for(spec: Spec, repository_uri: str, digest: str, env: dict[str, str]) -> docker_engine.DeployRequest:
    """The container request for this spec; reload mode always serves the live repository, explicitly."""
    d = spec.deploy
    extra: list[str] = []
    if d.rollout == "reload":
        repository_uri = s3.triton_uri(spec.storage, f"{live_prefix(spec.storage, d.name)}/model_repository")
        digest = live_digest(spec.storage, d.name)
        extra = list(EXPLICIT_ARGS)
    return docker_engine.DeployRequest(
        name=d.name, image=d.image, repository_uri=repository_uri, repo_digest=digest, env=env,
        ports=docker_engine.Ports(http=d.ports.http, grpc=d.ports.grpc, metrics=d.ports.metrics),
        standby_port_offset=d.standby_port_offset, shm_size=d.shm_size,
        ulimits={k: (v.soft, v.hard) for k, v in d.ulimits.items()}, ready_timeout_s=d.ready_timeout_s,
        extra_args=extra)


# ---------------------------------------------------------------- live repository (S3)


def read_live(s3c, storage: Storage, name: str) -> dict:
    """The live repository's state: {"version": N, "digest": …, "versions": {"N": digest}}; version 0 when empty."""
    key = f"{live_prefix(storage, name)}/{LIVE_STATE}"
    try:
        return json.loads(s3c.get_object(Bucket=storage.bucket, Key=key)["Body"].read())
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return {"version": 0, "digest": None, "versions": {}}
        raise


def _keys(s3c, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in s3c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def publish_version(s3c, storage: Storage, name: str, digest: str, log: Log) -> dict:
    """Copy the uploaded repository of ``digest`` into the live one as the next version; returns the new state.

    Server-side copies; version files before the configs so Triton never sees a config whose
    version folder is half there. Publishing the digest that is already live changes nothing.
    """
    state = read_live(s3c, storage, name)
    if state.get("digest") == digest:
        log(f"reload: digest {digest[:12]} is already live as version {state['version']}")
        return state
    src_root = f"{s3.repo_prefix(storage, digest)}/model_repository"
    dst_root = f"{live_prefix(storage, name)}/model_repository"
    src = _keys(s3c, storage.bucket, src_root + "/")
    if not src:
        raise RolloutError(f"no uploaded repository at s3://{storage.bucket}/{src_root}/ (digest {digest[:12]})")
    version = int(state.get("version", 0)) + 1
    pairs = [(k, version_key(k, src_root, dst_root, version)) for k in src]
    pairs = [(k, d) for k, d in pairs if d]
    configs = [(k, d) for k, d in pairs if d.endswith("/config.pbtxt") and d.count("/") == dst_root.count("/") + 2]
    for k, d in [p for p in pairs if p not in configs] + configs:
        s3c.copy_object(Bucket=storage.bucket, Key=d, CopySource={"Bucket": storage.bucket, "Key": k})
    new = {"version": version, "digest": digest, "previous": {"version": state.get("version"),
                                                              "digest": state.get("digest")},
           "versions": {**state.get("versions", {}), str(version): digest}}
    s3.put_json(s3c, storage, f"{live_prefix(storage, name)}/{LIVE_STATE}", new)
    log(f"reload: published digest {digest[:12]} as version {version} ({len(pairs)} objects)")
    return new


def drop_version(s3c, storage: Storage, name: str, version: int) -> None:
    """Delete one version folder of every live model (configs stay)."""
    root = f"{live_prefix(storage, name)}/model_repository/"
    doomed = [k for k in _keys(s3c, storage.bucket, root) if k.removeprefix(root).split("/")[1:2] == [str(version)]]
    for i in range(0, len(doomed), 1000):
        s3c.delete_objects(Bucket=storage.bucket, Delete={"Objects": [{"Key": k} for k in doomed[i:i + 1000]]})


def revert_live(s3c, storage: Storage, name: str, log: Log) -> dict:
    """Make the previous version the newest again: drop the newest, restore the previous configs."""
    state = read_live(s3c, storage, name)
    prev = (state.get("previous") or {}).get("version")
    prev_digest = (state.get("previous") or {}).get("digest")
    if not prev or not prev_digest:
        raise RolloutError(f"live repository of {name} has no previous version to return to")
    drop_version(s3c, storage, name, int(state["version"]))
    src_root = f"{s3.repo_prefix(storage, prev_digest)}/model_repository"
    dst_root = f"{live_prefix(storage, name)}/model_repository"
    for k in _keys(s3c, storage.bucket, src_root + "/"):
        d = version_key(k, src_root, dst_root, prev)
        if d and d.endswith("/config.pbtxt"):
            s3c.copy_object(Bucket=storage.bucket, Key=d, CopySource={"Bucket": storage.bucket, "Key": k})
    versions = {v: dg for v, dg in state.get("versions", {}).items() if int(v) != int(state["version"])}
    new = {"version": prev, "digest": prev_digest, "previous": None, "versions": versions}
    s3.put_json(s3c, storage, f"{live_prefix(storage, name)}/{LIVE_STATE}", new)
    log(f"reload: reverted live repository of {name} to version {prev} (digest {prev_digest[:12]})")
    return new


def prune_versions(s3c, storage: Storage, name: str, keep: int = 2) -> list[int]:
    """Delete all but the newest ``keep`` versions (the previous one stays for rollback)."""
    state = read_live(s3c, storage, name)
    old = sorted(int(v) for v in state.get("versions", {}))[:-keep] if keep else []
    for v in old:
        drop_version(s3c, storage, name, v)
    if old:
        state["versions"] = {v: d for v, d in state["versions"].items() if int(v) not in old}
        s3.put_json(s3c, storage, f"{live_prefix(storage, name)}/{LIVE_STATE}", state)
    return old


# ---------------------------------------------------------------- Triton model control


def load_model(http_url: str, model: str, timeout_s: float = 300) -> None:
    """POST /v2/repository/models/M/load; raises RolloutError with Triton's one-line reason."""
    req = urllib.request.Request(f"{http_url}/v2/repository/models/{model}/load", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s):
            return
    except urllib.error.HTTPError as err:
        try:
            reason = json.loads(err.read() or b"{}").get("error", "")
        except ValueError:
            reason = ""
        raise RolloutError(f"Triton refused to load {model}: HTTP {err.code} {reason.splitlines()[0] if reason else ''}"
                           ) from None
    except OSError as err:
        raise RolloutError(f"Triton at {http_url} did not answer the load of {model}: {err}") from None


def load_all(http_url: str, log: Log, models: tuple[str, ...] = LOAD_ORDER) -> float:
    t0 = time.perf_counter()
    for m in models:
        load_model(http_url, m)
    took = time.perf_counter() - t0
    log(f"reload: loaded {', '.join(models)} in {took:.1f} s")
    return took


# ---------------------------------------------------------------- what serves now


def serving(client, name: str) -> Serving | None:
    """The ready container of deployment ``name`` and what it serves (None when nothing does)."""
    for c in docker_engine._containers(client, name):  # newest first
        if c.status != "running" or not docker_engine._is_ready(c):
            continue
        args = c.attrs.get("Args") or []
        uri = next((a.split("=", 1)[1] for a in args if a.startswith("--model-repository=")), "")
        strategy = "reload" if "--model-control-mode=explicit" in args else "replace"
        image = (c.attrs.get("Config") or {}).get("Image", "")
        return Serving(strategy=strategy, container=c.name, repository_uri=uri,
                       digest=c.labels.get(docker_engine.LABEL_DIGEST, ""), image=image)
    return None


def rollout(spec: Spec, repository_uri: str, digest: str, log: Log) -> dict:
    """Serve ``digest`` (uploaded at ``repository_uri``) with the spec's strategy; returns what happened.

    Keys: strategy, container, http, grpc, metrics, reused, replaced, previous (Serving dict or None),
    and for reload: version, previous_version, load_s.
    """
    d = spec.deploy
    client = docker_engine.connect(d.docker_host)
    before = serving(client, d.name)
    env = s3.credentials_env() | {"AWS_DEFAULT_REGION": spec.storage.region}
    out: dict = {"strategy": d.rollout, "previous": before.to_dict() if before else None}
    if d.rollout == "reload":
        s3c = s3.client(spec.storage)
        prev_state = read_live(s3c, spec.storage, d.name)
        if before is not None and before.strategy == "reload":
            out["previous"]["version"] = prev_state.get("version")
            out["previous"]["digest"] = prev_state.get("digest") or before.digest
        state = publish_version(s3c, spec.storage, d.name, digest, log)
        res = docker_engine.deploy(client, request_for(spec, repository_uri, digest, env), log)
        out.update(version=state["version"], previous_version=prev_state.get("version") or None, load_s=0.0)
        if res.reused and state["version"] != prev_state.get("version"):
            try:
                out["load_s"] = load_all(res.http_url, log)
            except RolloutError:
                # Triton keeps the old version when a load fails; make S3 agree, then load it back.
                revert_live(s3c, spec.storage, d.name, log)
                load_all(res.http_url, log)
                raise
            prune_versions(s3c, spec.storage, d.name)
        reused = res.reused and state["version"] == prev_state.get("version")
    else:
        res = docker_engine.deploy(client, request_for(spec, repository_uri, digest, env), log)
        reused = res.reused
    ports = res.ports
    out.update(container=res.container_name, container_id=res.container_id, http=res.http_url, grpc=res.grpc_url,
               metrics=f"http://127.0.0.1:{ports.metrics}/metrics", reused=reused, replaced=res.replaced,
               digest=digest, repository_uri=repository_uri, image=d.image)
    return out


def roll_back(spec: Spec, done: dict, log: Log) -> dict:
    """Undo ``rollout``'s result ``done``: back to what served before, or nothing when nothing did."""
    d = spec.deploy
    t0 = time.perf_counter()
    client = docker_engine.connect(d.docker_host)
    prev = done.get("previous")
    env = s3.credentials_env() | {"AWS_DEFAULT_REGION": spec.storage.region}
    if done.get("reused"):
        return {"action": "none (the run changed nothing that serves)", "to": prev, "duration_s": 0.0}
    if d.rollout == "reload" and prev and prev.get("strategy") == "reload" and done.get("previous_version"):
        s3c = s3.client(spec.storage)
        state = revert_live(s3c, spec.storage, d.name, log)
        load_all(done["http"], log)
        action = f"reloaded version {state['version']}"
    elif prev:
        req = request_for(spec, prev["repository_uri"], prev["digest"], env)
        # Back to the exact container setup that served: its repository and its strategy.
        req = docker_engine.DeployRequest(**{**req.__dict__, "repository_uri": prev["repository_uri"],
                                             "repo_digest": prev["digest"], "image": prev["image"] or d.image,
                                             "extra_args": EXPLICIT_ARGS if prev["strategy"] == "reload" else []})
        res = docker_engine.deploy(client, req, log)
        action = f"redeployed {prev['digest'][:12]} as {res.container_name}"
    else:
        removed = docker_engine.remove_deployment(client, d.name, log)
        action = f"removed {', '.join(removed) or 'nothing'} (nothing served before)"
    log(f"rollback: {action}")
    return {"action": action, "to": prev, "duration_s": round(time.perf_counter() - t0, 3)}
