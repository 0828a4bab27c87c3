"""Routed heavy steps on the Prefect API: is there a worker to take them, and one routed run, watched.

A routed run is a flow run of a heavy_steps deployment (flows/heavy_steps.py) on its own work pool, e.g. a
docker pool on GPU hosts. Prefect would leave a run of a pool without workers Scheduled forever, so both the
preflight and the wait name the pool and fail instead of hanging.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable

from ..errors import StokerError

POLL_S = 1.0
# A worker's heartbeat is 30 s by default; the server marks it offline after a few missed ones.
_WAITING = {"SCHEDULED", "PENDING", "LATE"}


class RoutingError(StokerError):
    """A routed step cannot run: no such deployment, no worker on its pool, or the routed run failed."""


@dataclass(frozen=True)
class Route:
    deployment: str  # FLOW/DEPLOYMENT
    deployment_id: str
    pool: str
    workers: list[str]  # the pool's online workers when checked


def check_route(deployment: str, what: str = "routing.heavy") -> Route:
    """The deployment exists, and its work pool is not paused and has an online worker; else one line naming it
    (``what`` names who asks: a routed step, a watch, the webhook). Prefect would leave the run Scheduled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            raise RoutingError(f"{what}: deployment {deployment!r} is not registered on {client.api_url} "
                               "(prefect deploy --all registers prefect.yaml's deployments)") from None
        pool = dep.work_pool_name
        if not pool:
            raise RoutingError(f"{what}: deployment {deployment!r} has no work pool")
        try:
            wp = client.read_work_pool(pool)
        except ObjectNotFound:
            raise RoutingError(f"{what}: work pool {pool!r} of {deployment!r} does not exist") from None
        if wp.is_paused:
            raise RoutingError(f"{what}: work pool {pool!r} of {deployment!r} is paused")
        online = [w.name for w in client.read_workers_for_work_pool(pool) if w.status == WorkerStatus.ONLINE]
    if not online:
        raise RoutingError(f"{what}: work pool {pool!r} of {deployment!r} has no online worker; start one "
                           f"(prefect worker start --pool {pool} --type {wp.type})")
    return Route(deployment, str(dep.id), pool, online)


def run_routed(route: Route, parameters: dict, name: str, start_timeout_s: float, timeout_s: float,
               log: Callable[[str], None]) -> str:
    """Start the routed run as a subflow of the calling flow run and wait for it; returns its id.

    Not started by a worker within start_timeout_s (its pool's workers all gone since the preflight): the run is
    cancelled and RoutingError names the pool. Any end but Completed raises with the run's own message."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.flow_runs import run_deployment

    # An idempotency key of this call's own: Prefect's client resends a POST whose answer timed out (httpx
    # ReadTimeout; a slow server, e.g. SQLite "database is locked" under load), and without a key the server made a
    # second flow run of it, which a worker ran too (seen: two serve_host runs of one host, one after the other under
    # its lock). One key per call, not per name: a retried step's call must start a run of its own.
    run = run_deployment(route.deployment, parameters=parameters, flow_run_name=name, timeout=0, as_subflow=True,
                         tags=["stoker", "routed"], idempotency_key=f"{name}-{uuid.uuid4().hex}")
    log(f"routed: {route.deployment} run {run.name} ({run.id}) on pool {route.pool!r}")
    t0 = time.monotonic()
    started = False
    with get_client(sync_client=True) as client:
        while True:
            state = client.read_flow_run(run.id).state
            kind = state.type.value if state else "SCHEDULED"
            if state and state.is_final():
                break
            if kind in _WAITING and not started:
                if time.monotonic() - t0 > start_timeout_s:
                    _cancel(client, run.id)
                    raise RoutingError(f"routing.heavy: no worker of pool {route.pool!r} started {route.deployment} "
                                       f"run {run.name} within {start_timeout_s:g} s (cancelled)")
            elif not started:
                started = True
                log(f"routed: run {run.name} started after {time.monotonic() - t0:.1f} s")
            if time.monotonic() - t0 > timeout_s:
                _cancel(client, run.id)
                raise RoutingError(f"routing.heavy: run {run.name} on pool {route.pool!r} still going after "
                                   f"{timeout_s:g} s (cancelled)")
            time.sleep(POLL_S)
    if not state.is_completed():
        raise RoutingError(f"routed run {run.name} on pool {route.pool!r} ended {state.name}: "
                           f"{(state.message or '').strip() or 'no message'}")
    return str(run.id)


def _cancel(client, run_id) -> None:
    from prefect.states import Cancelling

    try:
        client.set_flow_run_state(run_id, Cancelling(message="stoker: routed run abandoned"), force=True)
    except Exception:  # noqa: BLE001 - best effort; the error raised next is what matters
        pass
