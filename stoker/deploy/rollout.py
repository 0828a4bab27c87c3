"""Rollout strategies behind a deployment's stable endpoint, and the way back.

Both strategies keep the address: clients talk to the deployment's proxy (``serving``), which
owns the spec's ports for the deployment's whole life.

``replace`` (default): a candidate backend is started on the free slot, proven (ready through a
settle window, a smoke inference streamed through ``ensemble``), then gated by the caller
(benchmark, evaluation) on its own ports, before it gets any traffic. ``go_live`` switches the
proxy, watches the new backend while the old one stays warm, switches back on a fault, and only
then retires the old one (``serving.promote``).

``reload``: one long-lived backend started with ``--model-control-mode=explicit`` serves a *live*
repository in S3 (``<prefix>/live/<name>/model_repository``); ``<prefix>/live/<name>/stoker-live.json`` (the
record) says which version it serves and which digest each version holds. A new build is never loaded before its
gates: ``stage`` starts it on a short-lived *gating candidate* (the free slot, the digest's own uploaded
repository, no traffic) and the caller's gates run there; only ``go_live`` publishes it into the live repository
as the next numeric version (version files first, then every config pinned to that version with
``version_policy: { specific: ... }``), loads it through Triton's model-control API (``POST
/v2/repository/models/M/load``: the new version loads next to the serving one, which retires only after the load
succeeded), runs a smoke inference, and only then rewrites the record (the gating candidate went first). A failed
load or smoke puts the recorded configs back and loads them again. Every reload ``stage`` first reconciles the
live repository with its record: version folders the record does not name (a run killed while publishing) are
removed, and a backend serving another version (Triton's repository index) loads the recorded one back. The
pinned configs make a restarted backend load exactly the recorded version, not the newest folder; the reload
backend answers ready while a version loads (``--strict-readiness=false``), so the proxy keeps it in service. The first
reload deploy (no reload backend yet) publishes the version and stages the reload backend itself as the
candidate, promoted like ``replace``; its record is written after the switch. GPU targets refuse ``reload`` at
plan (stoker/targets/gpu.py): a GPU backend mounts its engine from the host, and a gating candidate beside the
live one is what ``gpus.rollout`` decides.

Errors: ``RolloutError`` / ``PromotionFailed`` / ``DeployError`` (one-line cause).
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import docker.errors
from botocore.exceptions import ClientError

from .. import targets
from ..storage import credentials
from ..containers import argv_secret
from ..containers import engine as docker_engine
from ..storage import s3
from ..errors import StokerError
from ..run import stoker_home
from ..gpu import decision, openai_frontend
from ..serving import api_keys, deployment, edge, openai_service, probe, promote, signed_build, stop_first
from ..containers.ports import Ports
from ..spec.schema import Spec, Storage
from ..triton.config import ENSEMBLE_NAME, MODEL_NAME

Log = Callable[[str], None]
LIVE_STATE = "stoker-live.json"
GPUS_LABEL = "ai.stoker.gpus"  # stoker.targets.gpu.GPUS_LABEL: the device ids a backend holds
# Composing models before the ensemble, so the ensemble's first request after its
# reload already meets the new versions.
LOAD_ORDER = ("preprocessing", MODEL_NAME, "postprocessing", ENSEMBLE_NAME)
EXPLICIT_ARGS = ["--model-control-mode=explicit", "--load-model=*"]
# The reload backend keeps answering ready while a new version loads beside the serving one (Triton's strict
# readiness reports the whole server unready then, and the proxy would take it out of service: every request a 503
# for the length of the load). Startup still ends in ready only after the initial loads; the smoke proves a load.
RELOAD_ARGS = ["--strict-readiness=false"]


class RolloutError(StokerError):
    """A rollout or rollback failed; the message's first line is the cause."""


# ---------------------------------------------------------------- pure parts


def live_prefix(storage: Storage, name: str) -> str:
    return f"{storage.prefix}/live/{name}"


def live_digest(storage: Storage, name: str) -> str:
    """A stable stand-in for the backend's digest label: the reload backend never changes repository."""
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


def target_for(spec: Spec) -> promote.Target:
    d = spec.deploy
    target = targets.get(spec.target)
    return promote.Target(name=d.name, listen=Ports(d.ports.http, d.ports.grpc, d.ports.metrics),
                          proxy_image=d.proxy_image, state_dir=stoker_home() / "proxy" / d.name, address=d.listen,
                          keys=api_keys.load(d.api_keys) if d.api_keys else None,
                          tls=(d.tls.cert_file, d.tls.key_file) if d.tls else None,
                          # stoker's OpenAI service, for every target (stoker/targets/base.py: openai_image).
                          openai_image=target.openai_image(spec) if d.openai and target.openai_service else "",
                          openai_on_metrics=openai_frontend.renders(spec), replicas=d.replicas,
                          limits=edge.EdgeLimits(**d.limits.model_dump()))


def backend_spec(spec: Spec, repository_uri: str, digest: str, env: dict[str, str], run_id: str = "",
                 reload: bool | None = None, gpus: tuple[int, ...] = (), standin: bool = False) -> docker_engine.BackendSpec:
    """The backend for this spec: what its target supplies (image, command, mounts, devices: stoker/targets/) and
    what every backend shares; reload mode always serves the live repository, explicitly."""
    d = spec.deploy
    target = targets.get(spec.target)
    fields = {"interface": target.interface.layout, **target.backend(spec, repository_uri, gpus, standin)}
    extra = list(fields.pop("extra_args", []))
    env = fields.pop("env", env)  # a target that reads no S3 (a mounted repository) is given no credentials
    # The credentials folder, read-only: the environment holds only the file's path (credentials.container_env).
    fields["mounts"] = {**fields.get("mounts", {}), **credentials.mounts(env, credentials.folder_of(d.name))}
    if d.rollout == "reload" if reload is None else reload:
        fields["repository_uri"] = s3.triton_uri(spec.storage, f"{live_prefix(spec.storage, d.name)}/model_repository")
        digest = live_digest(spec.storage, d.name)
        extra += EXPLICIT_ARGS + RELOAD_ARGS
    elif spec.parallel.world_size == 1:
        # Explicit model control lets retire unload the old backend's models: it refuses new requests before any
        # answer while those in flight finish, so a busy long-lived stream moves without a cut answer
        # (serving.retire.refuse_new). Not with TP×PP > 1: its other ranks load only tensorrt_llm, and these
        # arguments reach every rank.
        extra += EXPLICIT_ARGS
    return docker_engine.BackendSpec(
        name=d.name, repo_digest=digest, env=env, shm_size=d.shm_size,
        ulimits={k: (v.soft, v.hard) for k, v in d.ulimits.items()}, ready_timeout_s=d.ready_timeout_s,
        extra_args=extra, run_id=run_id, **fields)


def held_gpus(client, spec: Spec, live: promote.topology.Backend | None = None) -> tuple[int, ...]:
    """The device ids the live backend of ``spec``'s deployment holds, all its replicas' (labels); () if none."""
    if live is None:  # the backend the proxy routes to now
        live = deployment.routed_backend(client, target_for(spec))
    if live is None:
        return ()
    try:
        return tuple(int(i) for m in (live, *live.members)
                     for i in client.containers.get(m.container).labels.get(GPUS_LABEL, "").split(",") if i)
    except docker.errors.NotFound:
        return ()


def candidate_gpus(client, spec: Spec, live: promote.topology.Backend | None,
                   gpu: dict | None = None) -> list[tuple[int, ...]]:
    """The device ids each replica of a new backend gets (one tuple per replica): under surge the set the live
    backend does not hold (blue/green across GPU sets), else the one set, split evenly over deploy.replicas;
    () each on CPU. ``gpu``: the run's decision (stoker/gpu/decision.py), whose sets are used as recorded; the
    live backend is looked at again, since another run may have switched since the decision."""
    n = spec.deploy.replicas
    if gpu and gpu.get("candidate") is not None and gpu.get("settled"):
        # Chosen under the deploy lock (decision.settle) from what serves: used as recorded, never picked again.
        chosen = tuple(gpu["candidate"])
        each = max(1, len(chosen) // n)
        return [tuple(chosen[r * each:(r + 1) * each]) for r in range(n)] if chosen else [()] * n
    sets = decision.sets_of(gpu) if gpu else targets.get(spec.target).gpu_sets(spec)
    if not sets:
        return [()] * n
    held = held_gpus(client, spec, live) if live is not None else ()
    chosen = next((s for s in sets if tuple(sorted(s)) != tuple(sorted(held))), sets[0])
    each = max(1, len(chosen) // n)
    return [tuple(chosen[r * each:(r + 1) * each]) for r in range(n)]


def backend_specs(spec: Spec, repository_uri: str, digest: str, env: dict[str, str], run_id: str,
                  gpus: list[tuple[int, ...]], reload: bool | None = None,
                  standin: bool = False) -> list[docker_engine.BackendSpec]:
    """One BackendSpec per replica (deploy.replicas), each with its own GPUs; ``standin``: the build's recorded
    stand-in decision (stoker/gpu/standin.py), refused here for an endpoint other machines reach."""
    from ..gpu.standin import check_recorded

    check_recorded(spec, standin)
    return [backend_spec(spec, repository_uri, digest, env, run_id, reload=reload, gpus=g, standin=standin)
            for g in gpus]


def container_env(spec: Spec) -> dict[str, str]:
    """The backends' environment; refreshes the deployment's credentials file first (stoker/storage/credentials.py)."""
    return credentials.refresh(spec)


# ---------------------------------------------------------------- live repository (S3)


def read_live(s3c, storage: Storage, name: str) -> dict:
    """The live repository's record: {"version": N, "digest": …, "versions": {"N": digest}}; version 0 when empty."""
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


def pin_version(config: str, version: int) -> str:
    """A model's config.pbtxt that loads only ``version``: Triton's default policy loads the newest folder, so a
    restarted backend would serve a half-published version. Replaces a policy pinned before. Pure."""
    kept = [line for line in config.splitlines() if not line.startswith("version_policy")]
    return "\n".join(kept).rstrip("\n") + f"\nversion_policy: {{ specific: {{ versions: [{version}] }} }}\n"


def folder_versions(keys: list[str], root: str) -> set[int]:
    """The version folders present under a live repository's ``root`` (``M/<N>/...``). Pure."""
    out = set()
    for k in keys:
        parts = k.removeprefix(root).lstrip("/").split("/")
        if len(parts) >= 3 and parts[1].isdigit():
            out.add(int(parts[1]))
    return out


def _roots(storage: Storage, name: str, digest: str) -> tuple[str, str]:
    return f"{s3.repo_prefix(storage, digest)}/model_repository", f"{live_prefix(storage, name)}/model_repository"


def write_configs(s3c, storage: Storage, name: str, digest: str, version: int) -> int:
    """Every model's config of ``digest``'s build into the live repository, pinned to ``version``; returns how many.
    Written after the version files they name (Triton reads a config, then its folder)."""
    src_root, dst_root = _roots(storage, name, digest)
    n = 0
    for k in _keys(s3c, storage.bucket, src_root + "/"):
        d = version_key(k, src_root, dst_root, version)
        if d and d.endswith("/config.pbtxt") and d.count("/") == dst_root.count("/") + 2:
            text = s3c.get_object(Bucket=storage.bucket, Key=k)["Body"].read().decode()
            s3c.put_object(Bucket=storage.bucket, Key=d, Body=pin_version(text, version).encode())
            n += 1
    return n


def publish_version(s3c, storage: Storage, name: str, digest: str, version: int, log: Log) -> int:
    """Copy the uploaded repository of ``digest`` into the live one as ``version`` (server-side copies, version files
    first, pinned configs last); the record is not touched (record_version, once the version serves)."""
    src_root, dst_root = _roots(storage, name, digest)
    src = _keys(s3c, storage.bucket, src_root + "/")
    if not src:
        raise RolloutError(f"no uploaded repository at s3://{storage.bucket}/{src_root}/ (digest {digest[:12]})")
    files = [(k, d) for k in src if (d := version_key(k, src_root, dst_root, version)) and not d.endswith(
        "/config.pbtxt")]
    for k, d in files:
        s3c.copy_object(Bucket=storage.bucket, Key=d, CopySource={"Bucket": storage.bucket, "Key": k})
    configs = write_configs(s3c, storage, name, digest, version)
    log(f"reload: published digest {digest[:12]} as version {version} ({len(files) + configs} objects; not "
        "recorded until it serves)")
    return version


def record_version(s3c, storage: Storage, name: str, digest: str, version: int, log: Log) -> dict:
    """The record names ``version`` (``digest``) as the one serving: written only once it serves."""
    state = read_live(s3c, storage, name)
    new = {"version": version, "digest": digest,
           "previous": {"version": state.get("version"), "digest": state.get("digest")},
           "versions": {**state.get("versions", {}), str(version): digest}}
    s3.put_json(s3c, storage, f"{live_prefix(storage, name)}/{LIVE_STATE}", new)
    log(f"reload: recorded version {version} (digest {digest[:12]}) as live in {LIVE_STATE}")
    return new


def drop_version(s3c, storage: Storage, name: str, version: int) -> None:
    """Delete one version folder of every live model (configs stay)."""
    root = f"{live_prefix(storage, name)}/model_repository/"
    doomed = [k for k in _keys(s3c, storage.bucket, root) if k.removeprefix(root).split("/")[1:2] == [str(version)]]
    _delete(s3c, storage.bucket, doomed)


def _delete(s3c, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        s3c.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})


def reconcile_live(s3c, storage: Storage, name: str, log: Log, client=None,
                   backend: promote.BackendRef | None = None) -> dict:
    """Make the live repository (and ``backend``, the reload backend, when given) agree with the record: version
    folders it does not name (a run killed while publishing, or before recording) are removed, the configs name the
    recorded version again, and a backend that serves another version (Triton's repository index) loads the
    recorded one back. Returns the record."""
    state = read_live(s3c, storage, name)
    root = f"{live_prefix(storage, name)}/model_repository/"
    keys = _keys(s3c, storage.bucket, root)
    recorded = int(state.get("version") or 0)
    stray = sorted(folder_versions(keys, root) - {int(v) for v in state.get("versions", {})})
    serving = ready_versions(client, backend) if backend is not None else {}
    other = sorted({v for vs in serving.values() for v in vs} - {recorded}) if recorded else []
    if not stray and not other:
        return state
    if not state.get("digest") and backend is not None:
        # A reload backend serves, yet nothing is recorded (the record was removed by hand): what it serves from
        # is not deleted under it, and nothing is guessed.
        raise RolloutError(f"the live repository of {name} holds version(s) {', '.join(map(str, stray))} but no "
                           f"{LIVE_STATE} while {backend.container} serves: deploy once with rollout: replace (the "
                           "next reload deploy then starts a reload backend from a clean repository)")
    if state.get("digest"):
        write_configs(s3c, storage, name, state["digest"], recorded)
    else:  # nothing was ever recorded: what is there is a first publish cut off, configs and all
        _delete(s3c, storage.bucket, keys)
    if other:
        load_all(client, backend, log)
    for v in stray:
        drop_version(s3c, storage, name, v)
    log(f"reload: the live repository of {name} now matches its record (version {recorded or 'none'}): "
        + (f"removed half-published version(s) {', '.join(map(str, stray))}" if stray else "")
        + (f"; {backend.container} served version(s) {other}, loaded version {recorded} back" if other else ""))
    return state


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


def ready_versions(client, backend: promote.BackendRef) -> dict[str, set[int]]:
    """What ``backend`` serves now, from Triton's repository index: model → versions READY ({} if it cannot say)."""
    try:
        admin = docker_engine.admin_headers(client.containers.get(backend.container))
        req = urllib.request.Request(f"{backend.http}/v2/repository/index", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json", **admin})
        with urllib.request.urlopen(req, timeout=10) as resp:
            rows = json.loads(resp.read() or b"[]")
    except (OSError, ValueError, docker.errors.NotFound):
        return {}
    out: dict[str, set[int]] = {}
    for r in rows:
        if r.get("state") == "READY" and str(r.get("version", "")).isdigit():
            out.setdefault(r["name"], set()).add(int(r["version"]))
    return out


def load_model(http_url: str, model: str, admin: dict[str, str], timeout_s: float = 300) -> None:
    """POST /v2/repository/models/M/load; raises RolloutError with Triton's one-line reason.

    ``admin``: the header that opens the backend's restricted model-control API (docker_engine.admin_headers)."""
    req = urllib.request.Request(f"{http_url}/v2/repository/models/{model}/load", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json", **admin})
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


def load_all(client, backend: promote.BackendRef, log: Log, models: tuple[str, ...] = LOAD_ORDER) -> float:
    admin = docker_engine.admin_headers(client.containers.get(backend.container))
    t0 = time.perf_counter()
    for m in models:
        load_model(backend.http, m, admin)
    took = time.perf_counter() - t0
    log(f"reload: loaded {', '.join(models)} in {took:.1f} s")
    return took


# ---------------------------------------------------------------- the promotion, strategy by strategy


def stage(spec: Spec, repository_uri: str, digest: str, run_id: str, log: Log, standin: bool = False,
          gpu: dict | None = None) -> dict:
    """Reconcile, then prepare ``digest`` to serve without giving it traffic; returns the staging record.
    ``gpu``: the run's GPU decision (stoker/gpu/decision.py): the candidate's GPU sets and the rollout (reload:
    the live backend stops first) come from it.

    Keys: strategy, reused (the digest already serves), in_place (reload: go_live loads it into the live
    backend, ``live``), candidate (the backend the gates run on) and previous (BackendRef dicts), endpoint (the
    stable addresses), version / previous_version (reload: the version it becomes, the one recorded now).
    """
    d = spec.deploy
    # Before anything that serves is touched: a repository that is not the signed build changes nothing.
    signed_build.check(spec, repository_uri, digest, log)
    # Every backend carries the shim that keeps its admin token off the command line: a host that cannot build it
    # (no compiler) is refused here, before any container is stopped or started.
    argv_secret.build()
    client = docker_engine.connect(d.docker_host)
    target = target_for(spec)
    live = promote.reconcile(client, target, log)
    previous = promote.BackendRef.of(live).to_dict() if live else None
    out = {"strategy": d.rollout, "endpoint": target.endpoint, "previous": previous, "reused": False,
           "in_place": False, "digest": digest, "repository_uri": repository_uri, "image": d.image}
    env = container_env(spec)
    reload_live = d.rollout == "reload" and live is not None and live.digest == live_digest(spec.storage, d.name)
    if d.rollout == "reload":
        s3c = s3.client(spec.storage)
        # From what actually runs: a half-published version goes, and the live backend serves the recorded one.
        state = reconcile_live(s3c, spec.storage, d.name, log, client,
                               promote.BackendRef.of(live) if reload_live else None)
        recorded = int(state.get("version") or 0)
        out.update(previous_version=recorded or None)
        if reload_live and state.get("digest") == digest:
            log(f"reload: digest {digest[:12]} is already live as version {recorded}")
            out.update(candidate=previous, version=recorded, reused=True)
            return out
        out["version"] = recorded + 1 if state.get("digest") != digest else recorded
        if reload_live:
            # Gated before any traffic: a short-lived candidate serves the digest's own repository on the free
            # slot; go_live loads it into the live backend only after the caller's gates passed there.
            out.update(in_place=True, live=previous)
            reload = False
        elif state.get("digest") != digest:
            # The first reload backend serves the live repository: the version is there before it starts, and
            # recorded only once the switch to it held (go_live).
            publish_version(s3c, spec.storage, d.name, digest, out["version"], log)
            out["publish"] = True
            reload = True
        else:
            reload = True
    elif live is not None and live.digest == digest:
        log(f"{live.container} already serves digest {digest[:12]}; reusing it")
        out.update(candidate=previous, reused=True)
        return out
    else:
        reload = None
    bspec = backend_specs(spec, repository_uri, digest, env, run_id, candidate_gpus(client, spec, live, gpu),
                          reload=reload, standin=standin)
    out.update(image=bspec[0].image, gpus=[i for b in bspec for i in b.labels.get(GPUS_LABEL, "").split(",") if i],
               replicas=len(bspec))
    gpu_rollout = decision.planned(gpu) if gpu else targets.get(spec.target).gpu_rollout(spec)
    try:
        out.update(start_candidate(client, target, spec, bspec, live, gpu_rollout, log))
    except BaseException:
        if out.get("publish"):  # the live repository goes back to its record
            reconcile_live(s3.client(spec.storage), spec.storage, d.name, log)
        raise
    return out


def start_candidate(client, target: promote.Target, spec: Spec, bspec: list[docker_engine.BackendSpec],
                    live: promote.topology.Backend | None, gpu_rollout, log: Log) -> dict:
    """Start and prove the candidate ``bspec`` beside ``live``; under a GPU reload rollout (``gpu_rollout``:
    stoker.gpu.rollout.Rollout) the live backend drains and stops first (kept, and started again if the
    candidate fails). Returns the staging record's candidate and gpu_rollout keys."""
    d = spec.deploy
    out: dict = {}
    if gpu_rollout is not None:
        out["gpu_rollout"] = {"choice": gpu_rollout.choice, "expected_gap_s": gpu_rollout.gap_s}
    if live is not None and gpu_rollout is not None and gpu_rollout.choice == "reload":
        # Neither fits beside the other: the live backend drains and stops (kept) before the candidate starts.
        log(f"GPU rollout reload: expected gap ~{gpu_rollout.gap_s:.0f} s (stoker plan)")
        out["gpu_rollout"]["stopped_at"] = stop_first.stop(client, target, promote.BackendRef.of(live),
                                                           d.drain_timeout_s, log)
        try:
            cand = promote.stage(client, target, bspec, None, d.settle_s, log,
                                 slot=promote.topology.other_slot(live.slot))
        except Exception:
            stop_first.restart(client, target, promote.BackendRef.of(live), d.ready_timeout_s, log)
            raise
        out["candidate"] = cand.to_dict()
        return out
    cand = promote.stage(client, target, bspec, live, d.settle_s, log)
    out["candidate"] = cand.to_dict()
    return out


def _follow_in_place(client, target: promote.Target, backend: promote.BackendRef, log: Log) -> None:
    """Reload mode: the backend loaded another version, so the OpenAI service reads that version's tokenizer."""
    if target.openai_image:
        openai_service.follow(client, target.state_dir, backend.container, log, refresh=True)


def go_live(spec: Spec, staged: dict, log: Log) -> dict:
    """Switch traffic to the staged candidate, watch it, then retire the old backend; returns what happened.

    A fault in the watch window switches traffic back to the old backend (still warm) and raises
    PromotionFailed naming the cause. Reload: the gated build is published, loaded into the live backend and
    smoke-tested, then recorded (``load_in_place``).
    """
    d = spec.deploy
    if staged.get("reused"):
        return {"switched": False, "reason": "the digest already serves"}
    if staged.get("in_place"):
        return load_in_place(spec, staged, log)
    client = docker_engine.connect(d.docker_host)
    target = target_for(spec)
    gap = staged.get("gpu_rollout") or {}
    if "stopped_at" not in gap:
        try:
            done = promote.go_live(client, target, staged, d.watch_s, d.max_error_rate_pct, d.drain_timeout_s, log,
                                   min_failures=d.watch_min_failures)
        except promote.PromotionFailed:
            if staged.get("publish"):
                reconcile_live(s3.client(spec.storage), spec.storage, d.name, log)
            raise
        if staged.get("publish"):  # the first reload backend serves its version: now the record says so
            s3c = s3.client(spec.storage)
            record_version(s3c, spec.storage, d.name, staged["digest"], staged["version"], log)
            prune_versions(s3c, spec.storage, d.name)
        return done
    # GPU reload: the old backend is stopped, so there is nothing warm to return to during the watch window.
    old = promote.BackendRef.from_dict(staged["previous"])
    try:
        done = promote.go_live(client, target, {**staged, "previous": None}, d.watch_s, d.max_error_rate_pct,
                               d.drain_timeout_s, log)
    except Exception:
        stop_first.restart(client, target, old, d.ready_timeout_s, log)
        raise
    done["gap_s"] = round(time.time() - gap["stopped_at"], 2)
    log(f"GPU rollout reload: the endpoint answered 503 for {done['gap_s']:.1f} s (expected "
        f"~{gap.get('expected_gap_s') or 0:.0f} s)")
    watched = promote.watch(client, promote.BackendRef.from_dict(done["live"]), d.watch_s, d.max_error_rate_pct, log,
                            min_failures=d.watch_min_failures)
    if not watched.healthy:
        promote.discard(client, promote.BackendRef.from_dict(done["live"]), log)
        stop_first.restart(client, target, old, d.ready_timeout_s, log)
        raise promote.PromotionFailed(f"{watched.cause}; {old.container} started again and serves")
    stop_first.remove(client, old, log)
    return done


def load_in_place(spec: Spec, staged: dict, log: Log) -> dict:
    """Reload, after the gates passed on the gating candidate: remove that candidate, publish the build as the staged
    version, load it into the live backend, smoke it there, then record it. A failed load or smoke
    puts the recorded version back (configs, then a load) and raises PromotionFailed; the record never moved."""
    d = spec.deploy
    client = docker_engine.connect(d.docker_host)
    target = target_for(spec)
    s3c = s3.client(spec.storage)
    live = promote.BackendRef.from_dict(staged["live"])
    gating = promote.BackendRef.from_dict(staged["candidate"])
    version, digest = int(staged["version"]), staged["digest"]
    promote.discard(client, gating, log)  # its gates passed and it never served; the load gets the host to itself
    state = read_live(s3c, spec.storage, d.name)
    if int(state.get("version") or 0) != int(staged.get("previous_version") or 0):
        raise promote.PromotionFailed(f"the live repository of {d.name} moved to version {state.get('version')} "
                                      f"since staging (version {staged.get('previous_version')}); nothing loaded")
    publish_version(s3c, spec.storage, d.name, digest, version, log)
    try:
        took = load_all(client, live, log)
        smoke = probe.smoke(live.http)
    except (RolloutError, probe.ProbeFailed) as err:
        # Triton keeps the old version when a load fails; the repository goes back to the record and is loaded.
        reconcile_live(s3c, spec.storage, d.name, log, client, live)
        load_all(client, live, log)
        _follow_in_place(client, target, live, log)
        raise promote.PromotionFailed(f"version {version} did not serve on {live.container} ({err}); version "
                                      f"{state.get('version')} loaded back and serves") from None
    record_version(s3c, spec.storage, d.name, digest, version, log)
    _follow_in_place(client, target, live, log)
    prune_versions(s3c, spec.storage, d.name)
    log(f"reload: {live.container} serves version {version} (digest {digest[:12]}); smoke inference streamed "
        f"{smoke['events']} responses")
    return {"switched": False, "reason": f"loaded in place as version {version}", "version": version,
            "load_s": round(took, 2), "live": live.to_dict()}


def abandon(spec: Spec, staged: dict, log: Log) -> str:
    """A staged candidate failed a gate: it never gets traffic, and the live repository's record never moved."""
    d = spec.deploy
    if staged.get("reused"):
        return "nothing to undo (the digest already served)"
    client = docker_engine.connect(d.docker_host)
    promote.discard(client, promote.BackendRef.from_dict(staged["candidate"]), log)
    if staged.get("in_place"):
        return (f"gating candidate removed; {staged['live']['container']} kept serving version "
                f"{staged.get('previous_version')}")
    if staged.get("publish"):  # the first reload backend's version was never recorded: it goes
        reconcile_live(s3.client(spec.storage), spec.storage, d.name, log)
    prev = staged.get("previous")
    if "stopped_at" in (staged.get("gpu_rollout") or {}) and prev:
        stop_first.restart(client, target_for(spec), promote.BackendRef.from_dict(prev), d.ready_timeout_s, log)
        return f"candidate removed; {prev['container']} started again and serves"
    return f"candidate removed; {prev['container']} kept serving" if prev else "candidate removed"
