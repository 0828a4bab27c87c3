"""rollback_fleet: every host of a fleet back to an earlier build, wave by wave (`stoker rollback NAME --fleet SPEC`,
or a run of this flow's deployment from the Prefect UI).

Under the deployment's lock (no fleet rollout meanwhile): the fleet's preflight (every engine answers and is its own,
every host's deployment has an online worker), then the plan for every host before any host changes (the run to go
back to: the fleet run ``to_run``'s part on that host, or `stoker rollback`'s own choice among that host's runs), then
wave by wave a rollback run on each host's worker, the host drained at the front meanwhile (tasks/fleet.py).
"""

from __future__ import annotations

from prefect import flow

from stoker.orchestration.exclusive import deploy_lock, exclusive
from stoker.run import RunContext, stoker_home
from stoker.serving.fleet import FleetError
from stoker.spec.schema import Spec
from tasks.fleet import fleet_preflight, plan_fleet_rollback, roll_back_fleet


@flow(name="rollback_fleet", log_prints=True)
def rollback_fleet(spec: Spec, to_run: str | None = None, reason: str = "stoker rollback --fleet") -> dict:
    """Every host of ``spec``'s fleet back to run ``to_run``'s build (a fleet run id), or each to the build it
    served before; returns per host its wave, status, digest before and after, and each wave's time."""
    if spec.fleet is None:
        raise FleetError(f"{spec.deploy.name}: the spec has no fleet section (stoker rollback without --fleet rolls "
                         "back one host)")
    with exclusive(deploy_lock(spec.deploy.name), print, f"another run is deploying {spec.deploy.name!r}"):
        fleet_preflight(spec)
        plan = plan_fleet_rollback(spec, to_run)
        return roll_back_fleet(spec, plan, RunContext.new(stoker_home()), reason).detail
