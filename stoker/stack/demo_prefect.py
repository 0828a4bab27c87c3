"""The demo's Prefect: a server that outlives the command, so its runs, logs and artifacts stay visible in the UI.

`stoker demo` runs the flow against, in this order of preference:
1. the Prefect API the user configured (PREFECT_API_URL in the environment or the active profile): theirs, never
   started or stopped by us;
2. the server of `make stack` (PostgreSQL, basic auth) when it runs under this STOKER_HOME;
3. its own `prefect server start` (SQLite under the demo's state dir, UI on, loopback only, no auth: Prefect's
   default for a local server), started once and reused by every later demo; `stoker down` stops it.

In cases 2 and 3 it also starts (or reuses) a process worker on the pool `stoker-demo` and registers
`build_and_deploy/demo` with the demo spec as its default parameters, so a run started from the UI's form works.
"""

from __future__ import annotations

import os
from pathlib import Path

from .prefect_stack import SERVER, PrefectApi, auth_string, ensure_server, ensure_worker
from .services import ServiceError, is_running, port_free

DEMO_POOL = "stoker-demo"
DEMO_DEPLOYMENT = "demo"
PORT = int(os.environ.get("STOKER_DEMO_PREFECT_PORT", "4200"))
ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) the worker runs flows from


def user_api() -> str | None:
    """The API the user pointed Prefect at, if any (environment first, then the active profile)."""
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    from prefect.settings import get_current_settings  # reads the profile; only when the env says nothing

    url = get_current_settings().api.url
    return str(url) if url else None


def ensure_api(state: Path, stack_state: Path, log=print) -> PrefectApi | None:
    """The server the demo reports to (see the module's docstring); None when the user's own API is configured."""
    if user_api():
        return None
    running = is_running(SERVER, stack_state)
    if running is not None:
        return PrefectApi(f"{running.url}/api", auth_string(stack_state))
    if is_running(SERVER, state) is None:
        log("demo: starting a local Prefect server (SQLite, UI) — once; later demos reuse it")
    port = PORT if port_free(PORT) or is_running(SERVER, state) else None
    return ensure_server(state, port=port, ui=True, auth=False, timeout_s=180)


def use_api(api: PrefectApi) -> None:
    """Point this process (and the flow it is about to run) at api."""
    os.environ.update(api.env())
    if "prefect" in __import__("sys").modules:  # settings were read at import: read them again
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def ensure_demo_worker(state: Path, api: PrefectApi) -> None:
    """A process worker on the demo's pool (created by the worker when missing), with this process's environment:
    the demo S3 server's keys and STOKER_HOME, so UI runs share the demo's cache and deployment."""
    from ..run import stoker_home

    from prefect.client.orchestration import get_client

    from ..commands.deploy_flows import ensure_work_pool

    with get_client(sync_client=True) as client:  # before the worker, so that it and we never race to create it
        ensure_work_pool(client, DEMO_POOL, "process")
    env = {"STOKER_HOME": str(stoker_home()), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    ensure_worker(state, api, DEMO_POOL, cwd=ROOT, env=env, timeout_s=120)
    wait_online(DEMO_POOL, state)


def wait_online(pool: str, state: Path, timeout_s: float = 120) -> None:
    """Until a worker of ``pool`` has sent the server a heartbeat. The worker's health port answers before it
    has registered: on a fresh SQLite database its first writes can meet the demo's own ("database is
    locked", which it retries), and a run submitted from the UI meanwhile would wait for a worker."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if any(w.status == WorkerStatus.ONLINE for w in client.read_workers_for_work_pool(pool)):
                return
            time.sleep(0.5)
    raise ServiceError(f"the demo's Prefect worker did not come online on pool {pool} within {timeout_s:.0f} s; "
                       f"see {state / 'logs' / f'prefect-worker-{pool}.log'}")


def register_deployment(flow, spec) -> str:
    """build_and_deploy/demo on the demo pool, the demo spec as its defaults (the UI's form starts from them).

    The entrypoint is a module path, not a file path: the worker imports `flows.build_and_deploy` from the
    installed package wherever it runs. Returns the deployment's id."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import EntrypointType
    from prefect.exceptions import ObjectNotFound

    from ..commands.deploy_flows import ensure_work_pool

    parameters = {"spec": spec.model_dump(mode="json")}
    with get_client(sync_client=True) as client:
        try:  # unchanged since the last demo: nothing to apply (an apply costs a schema build and a round trip)
            known = client.read_deployment_by_name(f"{flow.name}/{DEMO_DEPLOYMENT}")
            if known.parameters == parameters and known.work_pool_name == DEMO_POOL:
                return str(known.id)
        except ObjectNotFound:
            pass
        ensure_work_pool(client, DEMO_POOL, "process")  # the worker creates it too, but only once it first polls
    deployment = flow.to_deployment(
        name=DEMO_DEPLOYMENT, work_pool_name=DEMO_POOL, entrypoint_type=EntrypointType.MODULE_PATH,
        parameters=parameters, tags=["stoker", "demo"],
        description="The stoker demo: build, deploy and benchmark the tiny Llama (edit the form to change the spec)",
        enforce_parameter_schema=True)
    return str(deployment.apply())
