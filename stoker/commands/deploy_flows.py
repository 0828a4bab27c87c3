"""`stoker deploy-flows`: deployments/platform.yaml, then `prefect deploy --all`, against PREFECT_API_URL.

prefect.yaml (the repo root) declares the deployments, the Prefect way: pools, typed parameters, schedules,
triggers, concurrency. `prefect deploy` refuses a work pool that does not exist, and global concurrency limits
and standalone automations are not deployments, so platform.yaml declares those. This command applies the
pools and limits, runs Prefect's own `prefect --no-prompt deploy --all` (in the current folder, as `prefect
deploy` runs), checks that every deployment of the file was written, then applies the automations.
Re-applying updates in place.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import StokerError
from .deploy_checks import check_scheduled_workers, check_stack_specs

PLATFORM_FILE = Path("deployments/platform.yaml")
PREFECT_FILE = Path("prefect.yaml")
SPECS_DIR = Path("deployments/specs")  # the webhook receiver's specs (`stoker webhook serve --specs`)


class DeployFlowsError(StokerError):
    """A file is invalid, or the Prefect API or `prefect deploy` refused it."""


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


class Platform(_Strict):
    work_pools: list[WorkPool] = Field(default_factory=list)
    concurrency_limits: list[Limit] = Field(default_factory=list)
    automations: list[Path] = Field(default_factory=list)  # relative to the platform file


def _read_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise DeployFlowsError(f"{path}: no such file") from None
    except yaml.YAMLError as err:
        raise DeployFlowsError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None


def load_platform(path: Path) -> Platform:
    try:
        return Platform.model_validate(_read_yaml(path) or {})
    except ValidationError as err:
        first = err.errors()[0]
        raise DeployFlowsError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def deployment_names(prefect_file: Path) -> list[str]:
    """Each deployment's name in a prefect.yaml; one line for what `prefect deploy --all` would skip silently
    (it skips an unnamed deployment, and a file that fails its validation, and still exits 0)."""
    data = _read_yaml(prefect_file)
    deployments = data.get("deployments") if isinstance(data, dict) else None
    if not deployments or not isinstance(deployments, list):
        raise DeployFlowsError(f"{prefect_file}: no deployments")
    names = []
    for i, d in enumerate(deployments):
        for key in ("name", "entrypoint"):
            if not isinstance(d, dict) or not d.get(key):
                raise DeployFlowsError(f"{prefect_file}: deployments.{i}.{key}: required")
        if not (d.get("work_pool") or {}).get("name"):
            raise DeployFlowsError(f"{prefect_file}: deployments.{i}.work_pool.name: required")
        names.append(d["name"])
    return names


def apply_platform(cfg: Platform, log=print) -> None:
    """Create missing work pools; create or update the global concurrency limits."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
    )
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        for pool in cfg.work_pools:
            if ensure_work_pool(client, pool.name, pool.type, pool.concurrency_limit):
                log(f"work pool {pool.name} ({pool.type}): created")
            else:
                log(f"work pool {pool.name}: exists")
        for lim in cfg.concurrency_limits:
            try:
                client.read_global_concurrency_limit_by_name(lim.name)
                client.update_global_concurrency_limit(lim.name, GlobalConcurrencyLimitUpdate(limit=lim.limit))
                log(f"concurrency limit {lim.name}={lim.limit}: updated")
            except ObjectNotFound:
                try:
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(
                        name=lim.name, limit=lim.limit, slot_decay_per_second=lim.slot_decay_per_second))
                    log(f"concurrency limit {lim.name}={lim.limit}: created")
                except ObjectAlreadyExists:  # created concurrently: set its limit
                    client.update_global_concurrency_limit(lim.name, GlobalConcurrencyLimitUpdate(limit=lim.limit))
                    log(f"concurrency limit {lim.name}={lim.limit}: updated")


def ensure_work_pool(client, name: str, type_: str, concurrency_limit: int | None = None) -> bool:
    """Create the work pool unless it exists (a sync Prefect client); True when this call created it."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_work_pool(name)
        return False
    except ObjectNotFound:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type=type_, concurrency_limit=concurrency_limit,
                                                   base_job_template=default_job_template(type_)))
            return True
        except ObjectAlreadyExists:  # a worker starting on it created it between our read and create
            return False


def default_job_template(type_: str) -> dict:
    """The worker type's own job template (what `prefect work-pool create --type` sets), from its installed package
    (prefect-docker for "docker"); a pool created without one gives its deployments no job variables."""
    from prefect.workers.base import BaseWorker

    worker = BaseWorker.get_worker_class_from_type(type_)
    if worker is None:
        raise DeployFlowsError(f"work pool type {type_!r}: its worker package is not installed here "
                               "(docker: pip install prefect-docker)")
    return worker.get_default_base_job_template()


def prefect_deploy_all(prefect_file: Path, out=sys.stdout) -> None:
    """`prefect --no-prompt deploy --all --prefect-file FILE` in this folder; its output goes to `out`."""
    argv = [str(Path(sys.executable).with_name("prefect")), "--no-prompt", "deploy", "--all",
            "--prefect-file", str(prefect_file)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    out.write(proc.stdout)
    if proc.returncode != 0:
        cause = last_paragraph(proc.stdout + "\n" + proc.stderr) or "no output"
        raise DeployFlowsError(f"prefect deploy --all failed (exit {proc.returncode}): {cause}")


def written_stamps(names: list[str]) -> dict[str, tuple[str, object]]:
    """id → (name, updated) of the deployments with these names (any flow)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=names)))
    return {str(d.id): (d.name, d.updated) for d in found}


def last_paragraph(text: str) -> str:
    """The last block of non-empty lines as one line: Prefect's error message, which Rich wraps at 80 columns."""
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    return next((p for p in reversed(paragraphs) if p), "")


def check_written(names: list[str], before: dict[str, tuple[str, object]]) -> None:
    """Every deployment named in the file was created or updated since `before` (the server's own stamps,
    so no clock is compared)."""
    after = written_stamps(names)
    fresh = {name for id_, (name, updated) in after.items() if before.get(id_, (name, None))[1] != updated}
    missing = [n for n in names if n not in fresh]
    if missing:
        raise DeployFlowsError(f"prefect deploy --all did not write deployment(s) {', '.join(missing)}")


def apply_automation(path: Path) -> str:
    """Create (or replace) the automation defined in a YAML file, by name."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    wanted = Automation.model_validate(_read_yaml(path))
    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(wanted.name):  # replace: the file is the truth
            client.delete_automation(old.id)
    created = wanted.create()
    return f"automation {created.name}: applied ({created.id})"


def apply(platform_file: Path = PLATFORM_FILE, prefect_file: Path = PREFECT_FILE, log=print,
          specs_dir: Path | None = SPECS_DIR) -> list[str]:
    """Pools and limits, `prefect deploy --all`, automations; returns the deployments' names."""
    cfg = load_platform(platform_file)
    names = deployment_names(prefect_file)
    checked = check_stack_specs(prefect_file, specs_dir)
    log(f"specs of this stack: {checked} checked, no shared port or deployment name")
    apply_platform(cfg, log)
    for line in check_scheduled_workers(prefect_file):
        log(line)
    before = written_stamps(names)
    prefect_deploy_all(prefect_file)
    check_written(names, before)
    for auto in cfg.automations:
        log(apply_automation(Path(platform_file).parent / auto))
    return names


def _handler(args) -> int:
    names = apply(args.platform, args.prefect_file, specs_dir=args.specs)
    print(f"applied {len(names)} deployment(s) of {args.prefect_file}: {', '.join(names)}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("deploy-flows", help="create the work pools, limits and automations of "
                                            "deployments/platform.yaml, then `prefect deploy --all` (PREFECT_API_URL)")
    p.add_argument("--platform", type=Path, default=PLATFORM_FILE, help="pools, limits, automations")
    p.add_argument("--prefect-file", type=Path, default=PREFECT_FILE, help="the deployments (Prefect's prefect.yaml)")
    p.add_argument("--specs", type=Path, default=SPECS_DIR, help="the webhook's specs folder, checked with the "
                                                                 "watched specs for shared ports and names")
    p.set_defaults(fn=_handler)
