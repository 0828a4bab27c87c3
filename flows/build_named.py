"""build_named: the `stoker.build.requested` event's flow. It takes a spec's *name* in this checkout's
deployments/specs folder and a revision (as the webhook does), never a spec: whoever can emit an event to the Prefect
API gets only the builds the folder's owner wrote, not an image, a Docker host, an open address or pickled weights of
their own. It starts build_and_deploy/stoker-cpu with that spec pinned to the revision, and returns its run."""

from __future__ import annotations

from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import Field

from stoker.spec.named import REVISION, SPEC_NAME, SPECS_DIR, load_named

BUILD_DEPLOYMENT = "build_and_deploy/stoker-cpu"


@flow(name="build_named", log_prints=True)
def build_named(spec: Annotated[str, Field(pattern=SPEC_NAME, description="a spec of deployments/specs, by name")],
                revision: Annotated[str, Field(pattern=REVISION, description="branch, tag or sha to build")] = "main",
                repo: Annotated[str, Field(max_length=200, description="when given, must be the spec's repo")] = "",
                ) -> dict:
    from prefect.deployments.flow_runs import run_deployment

    from stoker.orchestration.routing import check_route

    chosen = load_named(SPECS_DIR, spec, revision, repo or None)  # one line (StokerError) for anything else
    check_route(BUILD_DEPLOYMENT, what=f"event build of {spec}")
    # One build per event run: a retry of this run gets the build it started back.
    run = run_deployment(BUILD_DEPLOYMENT, parameters={"spec": chosen.model_dump(mode="json")}, timeout=0,
                         idempotency_key=f"event:{flow_run.id}", as_subflow=False, tags=["stoker", "event"])
    get_run_logger().info("spec %s at %s → %s run %s (%s)", spec, revision, BUILD_DEPLOYMENT, run.name, run.id)
    return {"flow_run_id": str(run.id), "flow_run_name": run.name}
