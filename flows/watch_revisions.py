"""watch_revisions: a scheduled flow that starts build_and_deploy once per new commit of each watched repo.

Deduplication: every start is a flow-run creation with the idempotency key
``stoker-watch:<deployment>:<spec name>:<sha>``. Prefect's database holds a unique
index on (flow, idempotency key) and inserts with ON CONFLICT DO NOTHING, so two
watchers racing on the same new sha (two schedules, a manual run, two servers'
workers) create one run between them; the loser gets the winner's run back. We
chose this over a global concurrency limit (a lock would serialize watchers but
not remember what already ran) and over our own S3/DB conditional write (a second
store to keep consistent with Prefect's): the run *is* the record, in one place.
Each start carries a run name with this watcher's nonce, so a watcher can tell a
run it created from one it found.
"""

from __future__ import annotations

import uuid

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field, model_validator

from stoker.errors import SpecError
from stoker.spec.schema import Spec
from tasks import retry_transient

BUILD, MATRIX = "build_and_deploy/stoker-cpu", "build_matrix/matrix"


class Watch(BaseModel):
    """One watched model: the spec to build (its model.repo_id at model.revision) and the deployment to start."""

    model_config = ConfigDict(extra="forbid")
    spec: Spec
    deployment: str = Field(BUILD, description="FLOW/DEPLOYMENT to run per new sha")
    formats: list[str] = Field(default_factory=list, description="quantization formats: each new sha starts a "
                               f"matrix ({MATRIX}, its default deployment then) instead of one build")

    @model_validator(mode="before")
    @classmethod
    def _matrix_deployment(cls, data: object) -> object:
        # A watch with formats but no deployment means the matrix: the build deployment takes no `formats`.
        if isinstance(data, dict) and data.get("formats") and not data.get("deployment"):
            return {**data, "deployment": MATRIX}
        return data

    @model_validator(mode="after")
    def _matrix_entries(self) -> Watch:
        if self.formats:  # a bad entry is refused when the watch is read, not at the next new sha
            from stoker.plan.matrix import plan_entries

            if self.deployment.startswith("build_and_deploy/"):
                raise ValueError(f"formats start a matrix: {self.deployment} builds one format (use {MATRIX})")
            try:
                plan_entries(self.spec, self.formats)
            except SpecError as exc:
                raise ValueError(str(exc)) from None
        return self

    def parameters(self, spec: Spec) -> dict:
        """The started run's parameters: the pinned spec, and the formats when this watch starts a matrix."""
        return {"spec": spec.model_dump(mode="json"), **({"formats": self.formats} if self.formats else {})}


def dedup_key(watch: Watch, sha: str, adapters: dict[str, str] | None = None) -> str:
    """One run per new commit of the model, or of any of the spec's LoRA adapters (their shas join the key)."""
    if not adapters:
        return f"stoker-watch:{watch.deployment}:{watch.spec.deploy.name}:{sha}"
    import hashlib
    import json

    joined = hashlib.sha256(json.dumps(adapters, sort_keys=True).encode()).hexdigest()[:16]
    return f"stoker-watch:{watch.deployment}:{watch.spec.deploy.name}:{sha}+{joined}"


@task(name="resolve-revision", retries=2, retry_delay_seconds=[2, 5], retry_condition_fn=retry_transient,
      cache_policy=NO_CACHE, persist_result=False)
def resolve_revision(spec: Spec) -> str:
    """The commit sha the watched branch/tag points at now (through the Hub or its mirror), with the Hub token
    of the spec's Prefect Secret block, else of its environment variable."""
    from stoker.storage.hub import resolve
    from stoker.storage.source import hub_endpoint, hub_token

    return resolve(spec.model.repo_id, spec.model.revision, hub_endpoint(spec.model), hub_token(spec.model))


@task(name="resolve-adapters", retries=2, retry_delay_seconds=[2, 5], retry_condition_fn=retry_transient,
      cache_policy=NO_CACHE, persist_result=False)
def resolve_adapters(spec: Spec) -> dict[str, str]:
    """The commit each LoRA adapter's revision points at now: a new adapter commit is a new build too."""
    from stoker import adapters

    return adapters.resolve(spec)


@task(name="start-build", cache_policy=NO_CACHE, persist_result=False)
def start_build(watch: Watch, sha: str, adapter_shas: dict[str, str] | None = None) -> dict:
    """Create the build run for this sha (idempotently); says whether this watcher created it."""
    from prefect.deployments.flow_runs import run_deployment

    from stoker.orchestration.routing import check_route

    # Prefect would leave a run of a pool with no worker Scheduled forever, and start it whenever one appears,
    # maybe long after a newer sha: refuse now, in one line; the next tick after a worker starts builds it.
    check_route(watch.deployment, what=f"watch {watch.spec.deploy.name}")
    # Pin the exact commit seen: a push between now and the fetch must not change what is built.
    spec = watch.spec.model_copy(update={"model": watch.spec.model.model_copy(update={"revision": sha})})
    if adapter_shas:  # each adapter pinned to the commit seen, like the model
        spec = spec.model_copy(update={"adapters": [a.model_copy(update={"revision": adapter_shas[a.name]})
                                                    for a in spec.adapters]})
    name = f"{watch.spec.deploy.name}-{sha[:10]}-{uuid.uuid4().hex[:6]}"
    run = run_deployment(watch.deployment, parameters=watch.parameters(spec), timeout=0,
                         idempotency_key=dedup_key(watch, sha, adapter_shas), flow_run_name=name, as_subflow=False,
                         tags=["stoker", "watcher"])
    return {"flow_run_id": str(run.id), "flow_run_name": run.name, "created": run.name == name}


@flow(name="watch_revisions", log_prints=True)
def watch_revisions(watches: list[Watch]) -> list[dict]:
    """Check every watched repo once; start one build per new sha; record what was seen and done."""
    logger = get_run_logger()
    rows = []
    for w in watches:
        row = {"spec": w.spec.deploy.name, "repo": w.spec.model.repo_id, "revision": w.spec.model.revision,
               "sha": None, "adapters": None, "action": None, "flow_run_id": None}
        try:
            sha = resolve_revision(w.spec)
            row["sha"] = sha
            adapter_shas = resolve_adapters(w.spec) if w.spec.adapters else None
            if adapter_shas:
                row["adapters"] = adapter_shas
            started = start_build(w, sha, adapter_shas)
            row["flow_run_id"] = started["flow_run_id"]
            row["action"] = "started" if started["created"] else "already started"
        except Exception as exc:  # noqa: BLE001 - one broken watch must not hide the others
            row["action"] = f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        logger.info(f"{row['repo']}@{row['revision']} = {row['sha']}: {row['action']} {row['flow_run_id'] or ''}")
        rows.append(row)
    create_table_artifact(rows, key="stoker-watch", description="what the revision watcher saw and did")
    if any((r["action"] or "").startswith("error") for r in rows):
        raise RuntimeError(f"{sum(1 for r in rows if r['action'].startswith('error'))} watch(es) failed")
    return rows
