"""serve_host: one fleet host's part of a fleet rollout, on that host's work pool (spec `fleet:`).

The fleet run (flows/build_and_deploy.py → tasks/fleet.py) starts it with `run_deployment`, wave by wave, with the
host's one-host spec (its engine, its ports, no fleet) and the repository digest the fleet built. Every step before
the deploy comes from the shared step cache (a step missing there fails the run: the build runs once, in the fleet
run), and an upload digest other than the fleet's is refused; then stage → gates → switch → watch → retire on this
host's engine, with no promote (the fleet run promotes once). Its manifest goes to S3 as runs/<run_id>/ (the fleet's
run id + "-" + the host), beside the others.

action "rollback": serve again what run ``to_run`` deployed on this host (`stoker rollback`'s own code, under this
host's deploy lock), which the fleet run asks of every host it switched when a later host fails, and
flows/rollback_fleet.py of every host (`stoker rollback NAME --fleet SPEC`).
"""

from __future__ import annotations

import time
from typing import Literal

from prefect import flow

from flows.build_and_deploy import Steps, build_steps, deploy_steps
from stoker.errors import one_line
from stoker.record.manifest import build_manifest, write_local
from stoker.run import RunContext, stoker_home
from stoker.serving.fleet import FleetError
from stoker.spec.schema import Spec
from tasks.s3 import store_manifest


@flow(name="serve_host", log_prints=True)
def serve_host(spec: Spec, run_id: str, host: str, digest: str | None = None,
               action: Literal["rollout", "rollback"] = "rollout", to_run: str | None = None,
               standin: bool = False, reason: str | None = None) -> dict:
    """Roll the fleet's build out on this host (``action`` rollout), or switch it back to run ``to_run``'s build
    (rollback); returns the host run's manifest (rollout) or the rollback's outcome."""
    if spec.fleet is not None:
        raise FleetError("serve_host takes one host's spec (fleet: null); the fleet run makes it")
    if action == "rollback":
        from stoker.commands.rollback import rollback_to
        from stoker.orchestration.exclusive import deploy_lock, exclusive, host_lock

        if not to_run:
            raise FleetError(f"serve_host {host}: rollback needs to_run (the run this host goes back to)")
        with exclusive(deploy_lock(host_lock(spec.deploy.name, host)), print,
                       f"another run is deploying {spec.deploy.name!r} on {host}"):
            done = rollback_to(spec.deploy.name, to_run, log=print, spec=spec, reason=reason or
                               f"fleet run {run_id.rsplit('-', 1)[0]} halted: host {host} switched back")
        return {"host": host, "action": "rollback", "run_id": done["run_id"], "digest": done["digest"]}
    if not spec.storage.shared_cache:
        raise FleetError("serve_host needs storage.shared_cache: true (the fleet's build reaches it through the bucket)")
    ctx = RunContext(run_id=run_id, home=stoker_home(), shared_cache=spec.storage, standin=standin)
    started, t0 = time.time(), time.perf_counter()
    steps, error = Steps(), None
    try:
        target, _fetched, built, packaged, uploaded = build_steps(spec, ctx, steps, cached_only=f"fleet host {host}")
        if digest and uploaded.digest != digest:
            raise FleetError(f"fleet host {host!r}: its build {uploaded.digest[:12]} is not the fleet's "
                             f"{digest[:12]} (the host does not rebuild)")
        deploy_steps(target, spec, ctx, steps, False, built, packaged, uploaded, host=host)
    except BaseException as exc:
        error = one_line(exc) or type(exc).__name__
        raise
    finally:
        manifest = build_manifest(spec, ctx, steps, steps["fetch"].detail if "fetch" in steps else {}, started,
                                  time.perf_counter() - t0, "failed" if error else "completed", error)
        manifest.update(kind="serve_host", fleet_host=host)
        try:
            store_manifest(spec, manifest)
        finally:
            write_local(ctx, manifest)
    return manifest
