"""What `stoker deploy-flows` checks before it writes a deployment that would fail later, unattended.

A schedule or a watch fires with nobody watching: a clash of ports between two specs of the stack would surface
as a failed build minutes later (refused here, in one line), and a pool with no worker as runs piling up
Scheduled forever. Workers come and go after deploy time, so the watcher refuses that at each tick
(flows/watch_revisions.py); here it is a warning, so that deployments can be applied before their workers start.
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from ..errors import StokerError

DEMO_SPEC = Path(__file__).resolve().parents[1] / "demo.yaml"
# A worker started just before us (make stack) registers on its first poll; give it that long to show up.
WORKER_WAIT_S = 5.0


class NotRegistered(StokerError):
    """A watch starts a deployment that neither the file nor the server has."""


def check_stack_specs(prefect_file: Path | None, specs_dir: Path | None) -> int:
    """The watched specs, the webhook's specs and the demo's, side by side on one host: no shared port or name."""
    from ..spec import stack as stack_specs
    from ..spec.load import load_spec

    groups = [{f"the demo ({DEMO_SPEC.name})": load_spec(DEMO_SPEC)}]
    if prefect_file is not None:
        groups.append(stack_specs.prefect_yaml_specs(prefect_file))
    if specs_dir is not None and Path(specs_dir).is_dir():
        groups.append(stack_specs.folder_specs(specs_dir))
    return stack_specs.check(groups)


def scheduled_pools(prefect_file: Path) -> dict[str, str]:
    """{what fires unattended: its work pool} for a prefect.yaml: each deployment with a schedule, and each
    deployment its watches start (named FLOW/NAME; its pool when the file declares it, else None)."""
    data = yaml.safe_load(Path(prefect_file).read_text()) or {}
    deps = [d for d in data.get("deployments") or [] if isinstance(d, dict)]
    # The flow name of a file's deployment is its entrypoint's function name in stoker's flows.
    by_name = {f"{d.get('entrypoint', '').rsplit(':', 1)[-1]}/{d.get('name')}": d for d in deps}
    out: dict[str, str | None] = {}
    for full, d in by_name.items():
        if not (d.get("schedules") or d.get("schedule")):
            continue
        out[full] = (d.get("work_pool") or {}).get("name")
        for w in (d.get("parameters") or {}).get("watches") or []:
            target = (w or {}).get("deployment") or "build_and_deploy/stoker-cpu"
            out.setdefault(target, (by_name.get(target, {}).get("work_pool") or {}).get("name"))
    return out


def check_scheduled_workers(prefect_file: Path, wait_s: float = WORKER_WAIT_S) -> list[str]:
    """Each pool that scheduled or watched work lands on, and its online workers (waiting up to wait_s for one
    that is starting): one line per pool, a warning for a pool without any."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import WorkerStatus
    from prefect.exceptions import ObjectNotFound

    lines = []
    with get_client(sync_client=True) as client:
        for what, pool in scheduled_pools(prefect_file).items():
            if pool is None:
                try:
                    pool = client.read_deployment_by_name(what).work_pool_name
                except ObjectNotFound:
                    raise NotRegistered(f"{what}: started by a watch in {prefect_file}, but not registered") from None
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    online = [w.name for w in client.read_workers_for_work_pool(pool)
                              if w.status == WorkerStatus.ONLINE]
                except ObjectNotFound:
                    online = []
                if online or time.monotonic() > deadline:
                    break
                time.sleep(1)
            lines.append(f"work pool {pool}: {', '.join(online)} online ({what})" if online else
                         f"warning: {what} runs unattended on work pool {pool!r}, which has no online worker: "
                         f"until one starts, the watcher refuses to start its runs (prefect worker start --pool "
                         f"{pool})")
    return lines
