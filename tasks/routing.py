"""Routed heavy steps as a Prefect task: the heavy_steps run on its pool, then its results read back."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stoker.storage import s3
from stoker.orchestration.routing import check_route, run_routed
from stoker.run import RunContext, StepResult
from stoker.spec.schema import Spec


@task(name="route-heavy-steps", cache_policy=NO_CACHE, persist_result=False)
def route_heavy_steps(spec: Spec, fetched: StepResult, ctx: RunContext) -> dict:
    """Run heavy_steps on routing.heavy's pool for this spec at the fetched commit; returns its manifest."""
    log = get_run_logger().info
    r = spec.routing
    route = check_route(r.heavy)  # again: a worker may have gone since the preflight
    sha = (fetched.detail or {}).get("sha")
    pinned = spec.model_copy(update={"model": spec.model.model_copy(update={"revision": sha})}) if sha else spec
    run_id = f"{ctx.run_id}-heavy"
    flow_run = run_routed(route, {"spec": pinned.model_dump(mode="json"), "run_id": run_id, "standin": ctx.standin},
                          f"heavy-{spec.deploy.name}-{ctx.run_id}", r.start_timeout_s, r.timeout_s, log)
    st = spec.storage
    manifest = s3.get_json(s3.client(st), st, s3.run_manifest_key(st, run_id)) or {}
    return {"deployment": r.heavy, "pool": route.pool, "flow_run": flow_run, "run_id": run_id,
            "steps": manifest.get("steps", {}), "runner": manifest.get("runner")}


def mark_routed(result: StepResult, routed: dict) -> None:
    """The step's manifest entry says which run executed it, and whether that run built it or found it cached."""
    remote = routed["steps"].get(result.name, {})
    result.routed = {"deployment": routed["deployment"], "pool": routed["pool"], "flow_run": routed["flow_run"],
                     "layer": remote.get("layer"), "ran_on": remote.get("ran_on")}
