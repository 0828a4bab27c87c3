"""`stoker deploy-flows [FILE]`: apply deployments/deployments.yaml to the Prefect API (PREFECT_API_URL).

Work pools, global concurrency limits, the flow deployments (with their schedules
and parameters; specs named by file are embedded as typed parameters, so the UI
shows the form) and the automations. Re-applying updates in place.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import StokerError

ENTRYPOINTS = {
    "build_and_deploy": "flows/build_and_deploy.py:build_and_deploy",
    "watch_revisions": "flows/watch_revisions.py:watch_revisions",
}
DEFAULT_FILE = Path("deployments/deployments.yaml")


class DeployFlowsError(StokerError):
    """The deployments file is invalid or the Prefect API refused it."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkPool(_Strict):
    name: str
    type: str = "process"
    concurrency_limit: int | None = None


class Limit(_Strict):
    name: str
    limit: int = Field(ge=1)
    slot_decay_per_second: float = 0.0


class WatchEntry(_Strict):
    spec_file: Path
    deployment: str = "build_and_deploy/stoker-cpu"


class DeploymentEntry(_Strict):
    name: str
    flow: str = Field(pattern="^(build_and_deploy|watch_revisions)$")
    work_pool: str
    description: str | None = None
    tags: list[str] = Field(default_factory=list)
    interval_s: float | None = Field(None, gt=0)
    concurrency_limit: int | None = None
    watches: list[WatchEntry] = Field(default_factory=list)  # watch_revisions only


class DeploymentsFile(_Strict):
    source: Path = Path("..")  # the checkout process workers run flows from, relative to this file
    work_pools: list[WorkPool] = Field(default_factory=list)
    concurrency_limits: list[Limit] = Field(default_factory=list)
    deployments: list[DeploymentEntry]
    automations: list[Path] = Field(default_factory=list)


def load(path: Path) -> DeploymentsFile:
    try:
        return DeploymentsFile.model_validate(yaml.safe_load(Path(path).read_text()))
    except FileNotFoundError:
        raise DeployFlowsError(f"{path}: no such file") from None
    except ValidationError as err:
        first = err.errors()[0]
        raise DeployFlowsError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def watch_parameters(entry: DeploymentEntry, base: Path) -> dict:
    from ..spec import load_spec

    watches = [{"spec": load_spec(base / w.spec_file).model_dump(mode="json"), "deployment": w.deployment}
               for w in entry.watches]
    return {"watches": watches}


def apply(path: Path, log=print) -> list[str]:
    """Create or update everything in the file; returns 'FLOW/NAME' of each deployment."""
    from prefect import flow as prefect_flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
        WorkPoolCreate,
    )
    from prefect.exceptions import ObjectNotFound

    cfg = load(path)
    base = Path(path).resolve().parent
    root = (base / cfg.source).resolve()
    with get_client(sync_client=True) as client:
        for pool in cfg.work_pools:
            try:
                client.read_work_pool(pool.name)
                log(f"work pool {pool.name}: exists")
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(name=pool.name, type=pool.type,
                                                       concurrency_limit=pool.concurrency_limit))
                log(f"work pool {pool.name} ({pool.type}): created")
        for lim in cfg.concurrency_limits:
            try:
                client.read_global_concurrency_limit_by_name(lim.name)
                client.update_global_concurrency_limit(lim.name, GlobalConcurrencyLimitUpdate(limit=lim.limit))
                log(f"concurrency limit {lim.name}={lim.limit}: updated")
            except ObjectNotFound:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(
                    name=lim.name, limit=lim.limit, slot_decay_per_second=lim.slot_decay_per_second))
                log(f"concurrency limit {lim.name}={lim.limit}: created")
    names = []
    for d in cfg.deployments:
        remote = prefect_flow.from_source(source=str(root), entrypoint=ENTRYPOINTS[d.flow])
        params = watch_parameters(d, base) if d.flow == "watch_revisions" else None
        remote.deploy(name=d.name, work_pool_name=d.work_pool, build=False, push=False, interval=d.interval_s,
                      parameters=params, tags=d.tags or None, description=d.description,
                      concurrency_limit=d.concurrency_limit, print_next_steps=False)
        names.append(f"{d.flow}/{d.name}")
        log(f"deployment {d.flow}/{d.name} → pool {d.work_pool}" + (f", every {d.interval_s:g} s" if d.interval_s else ""))
    for auto in cfg.automations:
        log(apply_automation(base / auto))
    return names


def apply_automation(path: Path) -> str:
    """Create (or replace) the automation defined in a YAML file, by name."""
    from prefect.automations import Automation

    data = yaml.safe_load(Path(path).read_text())
    wanted = Automation.model_validate(data)
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(wanted.name):  # replace: the file is the truth
            client.delete_automation(old.id)
    created = wanted.create()
    return f"automation {created.name}: applied ({created.id})"


def _handler(args) -> int:
    names = apply(args.file)
    print(f"applied {len(names)} deployment(s): {', '.join(names)}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("deploy-flows", help="register stoker's flows, work pools, limits and automations "
                                            "with the Prefect API (PREFECT_API_URL)")
    p.add_argument("file", type=Path, nargs="?", default=DEFAULT_FILE)
    p.set_defaults(fn=_handler)
