"""`stoker rollback NAME [--to RUN_ID] [--spec SPEC]`: serve again, at the same address, what an earlier run deployed.

Without --to: the newest build older than what serves now, among the runs that completed, passed their gates and
switched traffic to their build, that no earlier rollback rolled back from. A backend that still runs that digest (warm, e.g. during a
watch window) takes traffic at once; otherwise the run's build is staged on the free slot, proven, and switched to,
like any promotion.
Runs come from S3 (`<prefix>/runs/*/manifest.json`: every host's runs) merged with $STOKER_HOME/runs; the bucket is
the one this host's runs of NAME name, or --spec's. A target that mounts its repository from a folder (GPU) gets
the package step's folder when it still holds the build, else a verified copy of the run's upload
(stoker/serving/mounted_repository.py).
Each rollback, once decided, is recorded like a run (stoker/record/rollbacks.py: $STOKER_HOME/runs/<id>/ first, then
S3 beside the run manifests, then a Prefect event): the build it left is marked bad, so a later rollback never
returns to it and a pipeline run of it is refused unless forced.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import StokerError, one_line
from ..record import rollbacks
from ..record.returnable import (GATE_STEPS, REQUIRED_STEPS, RollbackError, _marked, choose,  # noqa: F401 - re-exported
                                 fleet_plan, returnable, returnable_runs)


def deployed_runs(home: Path, name: str) -> list[dict]:
    """Manifests of runs that may have put ``name`` live, oldest first (run ids sort by time): what `stoker cache
    prune` keeps (a wrong yes only keeps an entry longer). Rollback asks more of a build: returnable()."""
    from ..record.manifest import read_manifests

    out = []
    for m in read_manifests(home):
        steps = m.get("steps", {})
        dep, up, sw = steps.get("deploy", {}), steps.get("upload", {}), steps.get("switch")
        if (m.get("spec", {}).get("deploy", {}).get("name") == name and dep.get("status") == "completed"
                and up.get("status") == "completed"
                and (sw is None or sw.get("status") == "completed"
                     # a failed watch whose old backend was dead: this build kept serving
                     or (m.get("rollback") or {}).get("status") == "kept")
                and (m.get("rollback") or {}).get("status") != "rolled back"):
            out.append(m)
    return out


def history(name: str, home: Path, given=None) -> tuple[list[dict], list[dict], str]:
    """Every run manifest of ``name`` known here or in S3 (oldest first), its returnable builds, and where they
    were read from (for messages). Raises RollbackError in one line: no bucket to read, S3 unreachable or refusing."""
    from ..record import history as runs_history
    from ..record.manifest import read_manifests
    from ..storage import s3

    local = read_manifests(home)
    storages = runs_history.storages_of(local, name, given)
    if not storages:
        from ..containers import engine as docker_engine

        if not docker_engine.containers(docker_engine.connect(None), name):
            raise RollbackError(f"unknown deployment {name!r}: no containers and no runs of it under {home / 'runs'}")
        raise RollbackError(f"no runs of {name} under {home / 'runs'}, so no bucket to read its runs from: "
                            "pass --spec SPEC (its storage)")
    remote: list[dict] = []
    for st in storages:
        try:
            remote += runs_history.remote_manifests(s3.client(st), st, skip={m["run_id"] for m in local})
        except StokerError as err:
            raise RollbackError(f"cannot read the runs of {name} in S3, nothing changed: {err}") from None
    every = [m for m in runs_history.merge(local, remote)
             if ((m.get("spec") or {}).get("deploy") or {}).get("name") == name]
    where = " and ".join([str(home / "runs"), *map(runs_history.where, storages)])
    return every, returnable_runs(every, name), where


def rollback_to(name: str, run_id: str | None, log=print, spec_path: str | None = None,
                reason: str = "stoker rollback", spec=None) -> dict:
    """Serve run ``run_id``'s build again (default: choose()); recorded (stoker/record/rollbacks.py) once it is
    decided, whether it then completes or fails. ``spec``: the host's own spec (a fleet host, flows/serve_host.py):
    its engine and ports, where the newest run's spec may be another host's."""
    from ..containers import engine as docker_engine
    from ..deploy import rollout
    from ..run import stoker_home
    from ..serving import promote, topology
    from ..spec.load import load_spec, parse_spec

    home = stoker_home()
    every, runs, where = history(name, home, spec if spec is not None else load_spec(spec_path) if spec_path else None)
    if run_id and run_id not in {m["run_id"] for m in runs} and run_id in {m["run_id"] for m in every}:
        raise RollbackError(f"run {run_id} of {name} did not complete, pass its gates and switch traffic to its "
                            "build: rollback returns only to builds that did")
    if not runs:
        raise RollbackError(f"nothing to roll back to: no run of {name} that passed its gates and switched, in "
                            f"{where}")
    spec = spec if spec is not None else parse_spec(runs[-1]["spec"], f"manifest of {runs[-1]['run_id']}")
    client = docker_engine.connect(spec.deploy.docker_host)
    target = rollout.target_for(spec)
    backends = promote.observe_backends(client, name)
    view, _ = promote.observe_proxy(client, target)
    routed = next((b for b in backends if topology.routes_to(view, b)), None)
    live_digest = routed.digest if routed else None
    if routed and routed.digest == rollout.live_digest(spec.storage, name):
        # A reload backend's label names its live repository; the build it serves is in the S3 live state.
        from ..storage import s3

        live_digest = rollout.read_live(s3.client(spec.storage), spec.storage, name).get("digest")
    bad = rollbacks.bad_builds(every)
    try:
        chosen = choose(runs, run_id, live_digest, bad, anchor=None if live_digest else rollbacks.current(every))
    except RollbackError as err:
        if run_id:
            raise
        raise RollbackError(f"{err} (runs read from {where})") from None
    try:
        done = _return_to(chosen, spec, client, target, backends, view, routed, home, log)
    except BaseException as exc:
        _record(name, spec, every, live_digest, chosen, reason, target, home, log,
                "failed" if isinstance(exc, Exception) else "cancelled", one_line(exc) or type(exc).__name__)
        raise
    _record(name, spec, every, live_digest, chosen, reason, target, home, log, "completed")
    return done


def _record(name, spec, every, live_digest, chosen, reason, target, home, log, status, error=None) -> None:
    """The rollback's record: on disk first (nothing after it can lose it), then in S3 beside the run manifests,
    then a Prefect event; S3 or the event failing is one warning line, the local record stands."""
    from ..record.manifest import write_local
    from ..run import RunContext
    from ..storage import s3

    record_id = rollbacks.new_id()
    source = next((m for m in reversed(every) if not rollbacks.is_rollback(m)
                   and ((m.get("steps") or {}).get("upload") or {}).get("digest") == live_digest), None) \
        if live_digest else None
    rec = rollbacks.build_record(record_id, name, chosen["spec"], source, live_digest, chosen, reason, status, error,
                                 target.endpoint)
    path = write_local(RunContext(run_id=record_id, home=home), rec)
    where = [str(path)]
    try:
        where.append(s3.put_json(s3.client(spec.storage), spec.storage,
                                 s3.run_manifest_key(spec.storage, record_id), rec))
    except Exception as err:  # noqa: BLE001 - the local record stands; S3 may be what failed the rollback
        log(f"warning: rollback record not stored in S3: {one_line(err)}")
    rollbacks.emit(rec, name, log)
    log(f"rollback {name}: {status}, recorded as {record_id} ({', '.join(where)})")


def _return_to(chosen, spec, client, target, backends, view, routed, home, log) -> dict:
    """Stage (or take warm) the chosen run's build and switch traffic to it."""
    from ..deploy import rollout
    from ..gpu import decision
    from ..serving import mounted_repository, promote, signed_build, topology
    from ..spec.load import parse_spec

    name = spec.deploy.name
    up = chosen["steps"]["upload"]
    warm = next((b for b in backends if b is not routed and b.digest == up["digest"] and b.ready and view.running),
                None)
    log(f"rollback {name}: to run {chosen['run_id']} (digest {up['digest'][:12]})"
        + (f", warm in {warm.container}" if warm else ""))
    if warm is None:
        run_spec = parse_spec(chosen["spec"], f"manifest of {chosen['run_id']}")
        # Where that run's backend loaded its repository (a GPU target mounts the package step's folder), else S3.
        repository = (chosen["steps"].get("deploy", {}).get("detail") or {}).get("repository_uri") \
            or up["detail"]["repository_uri"]
        if not repository.startswith("s3://"):
            # A folder on this host, which `stoker cache prune` may have removed (or another host's run recorded):
            # that folder while it holds the build, else a verified copy of the run's upload. Before anything
            # that serves is touched, so a missing or mismatching build changes nothing.
            folder, source = mounted_repository.local_copy(run_spec.storage, up["digest"], Path(repository), home, log)
            log(f"rollback {name}: repository: {source}")
            repository = str(folder)
        # Verified against that build's signature (signed builds, when a key is configured) before anything serves.
        signed_build.check(run_spec, repository, up["digest"], log)
        live = promote.reconcile(client, target, log)
        # The stand-in as that run recorded it, never this shell's environment (stoker/gpu/standin.py).
        ran_standin = bool((chosen.get("standin") or {}).get("ran"))
        # GPU targets: that run's GPU decision (its sets; a reload rollout stops the live backend first).
        gpu = (chosen["steps"].get("gpu-rollout") or {}).get("detail")
        bspec = rollout.backend_specs(run_spec, repository, up["digest"], rollout.container_env(run_spec),
                                      chosen["run_id"], rollout.candidate_gpus(client, run_spec, live, gpu),
                                      reload=False, standin=ran_standin)
        started = rollout.start_candidate(client, target, spec, bspec, live, decision.planned(gpu), log)
        cand = promote.BackendRef.from_dict(started["candidate"])
        gpu_rollout = started.get("gpu_rollout")
    else:
        live, cand, gpu_rollout = routed, promote.BackendRef.of(warm), None
    old = promote.BackendRef.of(live) if isinstance(live, topology.Backend) else None
    staged = {"candidate": cand.to_dict(), "previous": old.to_dict() if old else None,
              **({"gpu_rollout": gpu_rollout} if gpu_rollout else {})}
    done = rollout.go_live(spec, staged, log)
    return {"run_id": chosen["run_id"], "digest": up["digest"], "endpoint": target.endpoint, **done}


def _handler(args) -> int:
    import contextlib
    import os

    from ..orchestration.exclusive import deploy_lock, exclusive

    if args.fleet:
        return _fleet(args)
    # With a Prefect API (the stack's, or the demo's) a rollback waits for a run deploying the same name; without
    # one, Prefect would start a throwaway API for this process alone, which no other run would see.
    held = (exclusive(deploy_lock(args.name), print, f"a run is deploying {args.name!r}")
            if os.environ.get("PREFECT_API_URL") else contextlib.nullcontext())
    with held:
        done = rollback_to(args.name, args.to or args.run_id, spec_path=args.spec, reason=args.reason)
    print(f"serving run {done['run_id']} (digest {done['digest'][:12]}) at {done['endpoint']['http']} "
          f"via {done['live']['container']}")
    return 0


def _fleet(args) -> int:
    """Every host of the fleet back, wave by wave, through each host's worker (flows/rollback_fleet.py)."""
    import os

    from ..launch import run_fleet_rollback
    from ..spec.load import load_spec

    if args.spec:
        raise RollbackError("give --spec or --fleet, not both (--fleet SPEC names the fleet's storage too)")
    if not os.environ.get("PREFECT_API_URL"):
        raise RollbackError("--fleet needs PREFECT_API_URL: the Prefect server whose workers serve the fleet's hosts")
    spec = load_spec(args.fleet)
    if spec.fleet is None:
        raise RollbackError(f"{args.fleet}: no fleet section (stoker rollback without --fleet rolls back this host)")
    if spec.deploy.name != args.name:
        raise RollbackError(f"{args.fleet} deploys {spec.deploy.name!r}, not {args.name!r}")
    # Refused here, in one line, before the flow starts: a host without an online worker, an engine that does not
    # answer, a host with nowhere to go (the flow decides again under the deployment's lock).
    from ..orchestration.routing import check_route

    for h in spec.fleet.hosts:
        check_route(h.deployment, what=f"fleet host {h.name!r}")
    from ..serving.fleet import fleet_rollback_plan

    fleet_rollback_plan(spec, args.to or args.run_id)
    detail = run_fleet_rollback(spec, args.to or args.run_id, args.reason)
    for host, rec in detail["hosts"].items():
        print(f"{host}: {rec['status']}, serving {(rec['after'] or '-')[:12]} (run {rec['to_run']})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollback", help="serve again, at the same address, what an earlier run deployed")
    p.add_argument("name", help="deploy.name of the spec")
    p.add_argument("run_id", nargs="?", default=None, help=argparse.SUPPRESS)  # the older positional form
    p.add_argument("--to", default=None, metavar="RUN_ID", help="default: the newest run serving something else")
    p.add_argument("--reason", default="stoker rollback", help="why, in the rollback's record (default: %(default)s)")
    p.add_argument("--spec", default=None, metavar="SPEC",
                   help="a spec of the deployment: its runs are read from its storage too (needed when this host "
                        "holds none of them; otherwise the storage its local runs name is read)")
    p.add_argument("--fleet", default=None, metavar="SPEC",
                   help="a spec with fleet: every host back, wave by wave, each through its own worker; --to names "
                        "a fleet run (default: each host to the build it served before; needs PREFECT_API_URL)")
    p.set_defaults(fn=_handler)
