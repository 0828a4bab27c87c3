"""`stoker rollback NAME [--to RUN_ID]`: serve again, at the same address, what an earlier run deployed.

Without --to: the newest completed run whose repository differs from what serves now. A backend
that still runs that digest (warm, e.g. during a watch window) takes traffic at once; otherwise
the run's build is staged on the free slot, proven, and switched to, like any promotion.
Reads run manifests from $STOKER_HOME/runs; the repository is still in S3 (digests are never deleted).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import StokerError


class RollbackError(StokerError):
    """No earlier run to return to, an unknown deployment, or the way back failed."""


def deployed_runs(home: Path, name: str) -> list[dict]:
    """Manifests of runs that put ``name`` live, oldest first (run ids sort by time)."""
    from ..record.manifest import read_manifests

    out = []
    for m in read_manifests(home):
        steps = m.get("steps", {})
        dep, up, sw = steps.get("deploy", {}), steps.get("upload", {}), steps.get("switch")
        if (m.get("spec", {}).get("deploy", {}).get("name") == name and dep.get("status") == "completed"
                and up.get("status") == "completed" and (sw is None or sw.get("status") == "completed")
                and (m.get("rollback") or {}).get("status") != "rolled back"):
            out.append(m)
    return out


def choose(runs: list[dict], run_id: str | None, live_digest: str | None) -> dict:
    """The manifest to return to: RUN_ID's, or the newest whose digest is not the live one. Pure."""
    if run_id:
        for m in runs:
            if m["run_id"] == run_id:
                if m["steps"]["upload"]["digest"] == live_digest:
                    raise RollbackError(f"run {run_id} deployed digest {live_digest[:12]}, which already serves")
                return m
        raise RollbackError(f"run {run_id} did not deploy this deployment (or its manifest is not here)")
    for m in reversed(runs):
        if m["steps"]["upload"]["digest"] != live_digest:
            return m
    raise RollbackError("nothing to roll back to: no earlier run deployed anything else")


def rollback_to(name: str, run_id: str | None, log=print) -> dict:
    from ..containers import engine as docker_engine
    from ..deploy import rollout
    from ..gpu import decision
    from ..run import stoker_home
    from ..serving import promote, topology
    from ..spec.load import parse_spec

    home = stoker_home()
    runs = deployed_runs(home, name)
    client = None
    if not runs:
        client = docker_engine.connect(None)
        if not docker_engine.containers(client, name):
            raise RollbackError(f"unknown deployment {name!r}: no containers and no runs of it under {home / 'runs'}")
        raise RollbackError(f"nothing to roll back to: no completed runs of {name} under {home / 'runs'}")
    spec = parse_spec(runs[-1]["spec"], f"manifest of {runs[-1]['run_id']}")
    client = docker_engine.connect(spec.deploy.docker_host)
    target = rollout.target_for(spec)
    backends = promote.observe_backends(client, name)
    view, _ = promote.observe_proxy(client, target)
    routed = next((b for b in backends if view.running and b.slot == view.live and b.running
                   and view.http_ports.get(b.slot) == b.ports.http), None)
    live_digest = routed.digest if routed else None
    if routed and routed.digest == rollout.live_digest(spec.storage, name):
        # A reload backend's label names its live repository; the build it serves is in the S3 live state.
        from ..storage import s3

        live_digest = rollout.read_live(s3.client(spec.storage), spec.storage, name).get("digest")
    chosen = choose(runs, run_id, live_digest)
    up = chosen["steps"]["upload"]
    warm = next((b for b in backends if b is not routed and b.digest == up["digest"] and b.ready and view.running),
                None)
    log(f"rollback {name}: to run {chosen['run_id']} (digest {up['digest'][:12]})"
        + (f", warm in {warm.container}" if warm else ""))
    if warm is None:
        live = promote.reconcile(client, target, log)
        run_spec = parse_spec(chosen["spec"], f"manifest of {chosen['run_id']}")
        # Where that run's backend loaded its repository (a GPU target mounts the package step's folder), else S3.
        repository = (chosen["steps"].get("deploy", {}).get("detail") or {}).get("repository_uri") \
            or up["detail"]["repository_uri"]
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

    # With a Prefect API (the stack's, or the demo's) a rollback waits for a run deploying the same name; without
    # one, Prefect would start a throwaway API for this process alone, which no other run would see.
    held = (exclusive(deploy_lock(args.name), print, f"a run is deploying {args.name!r}")
            if os.environ.get("PREFECT_API_URL") else contextlib.nullcontext())
    with held:
        done = rollback_to(args.name, args.to or args.run_id)
    print(f"serving run {done['run_id']} (digest {done['digest'][:12]}) at {done['endpoint']['http']} "
          f"via {done['live']['container']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollback", help="serve again, at the same address, what an earlier run deployed")
    p.add_argument("name", help="deploy.name of the spec")
    p.add_argument("run_id", nargs="?", default=None, help=argparse.SUPPRESS)  # the older positional form
    p.add_argument("--to", default=None, metavar="RUN_ID", help="default: the newest run serving something else")
    p.set_defaults(fn=_handler)
