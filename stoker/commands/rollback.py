"""`stoker rollback NAME [RUN_ID]`: serve again what an earlier run of deployment NAME deployed.

Without RUN_ID: the newest completed run whose repository differs from what serves now.
Reads run manifests from $STOKER_HOME/runs; the repository is still in S3 (digests are
never deleted), and the run's own spec says how to roll it out (replace or reload).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import StokerError


class RollbackError(StokerError):
    """No earlier run to return to, or the rollout back failed."""


def deployed_runs(home: Path, name: str) -> list[dict]:
    """Manifests of runs that deployed ``name`` successfully, oldest first (run ids sort by time)."""
    out = []
    for path in sorted((home / "runs").glob("*/manifest.json")):
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        dep, up = m.get("steps", {}).get("deploy", {}), m.get("steps", {}).get("upload", {})
        if (m.get("spec", {}).get("deploy", {}).get("name") == name and dep.get("status") == "completed"
                and up.get("status") == "completed" and (m.get("rollback") or {}).get("status") != "rolled back"):
            out.append(m)
    return out


def choose(runs: list[dict], run_id: str | None, live_digest: str | None) -> dict:
    """The manifest to return to: RUN_ID's, or the newest whose digest is not the live one. Pure."""
    if run_id:
        for m in runs:
            if m["run_id"] == run_id:
                return m
        raise RollbackError(f"run {run_id} did not deploy this deployment (or its manifest is not here)")
    for m in reversed(runs):
        if m["steps"]["upload"]["digest"] != live_digest:
            return m
    raise RollbackError("no earlier run deployed anything else")


def rollback_to(name: str, run_id: str | None, log=print) -> dict:
    from .. import docker_engine, rollout, s3
    from ..run import stoker_home
    from ..spec import parse_spec

    runs = deployed_runs(stoker_home(), name)
    if not runs:
        raise RollbackError(f"no completed runs of deployment {name} under {stoker_home() / 'runs'}")
    spec = parse_spec(runs[-1]["spec"], f"manifest of {runs[-1]['run_id']}")
    now = rollout.serving(docker_engine.connect(spec.deploy.docker_host), name)
    live = now.digest if now else None
    if now and now.strategy == "reload":
        live = rollout.read_live(s3.client(spec.storage), spec.storage, name).get("digest")
    target = choose(runs, run_id, live)
    spec = parse_spec(target["spec"], f"manifest of {target['run_id']}")
    up = target["steps"]["upload"]
    log(f"rollback {name}: to run {target['run_id']} (digest {up['digest'][:12]}, strategy {spec.deploy.rollout})")
    done = rollout.rollout(spec, up["detail"]["repository_uri"], up["digest"], log)
    return {"run_id": target["run_id"], "digest": up["digest"], **done}


def _handler(args) -> int:
    done = rollback_to(args.name, args.run_id)
    print(f"serving run {done['run_id']} (digest {done['digest'][:12]}) at {done['http']} via {done['container']}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("rollback", help="serve again what an earlier run of a deployment deployed")
    p.add_argument("name", help="deploy.name of the spec")
    p.add_argument("run_id", nargs="?", default=None, help="default: the newest run serving something else")
    p.set_defaults(fn=_handler)
