"""Matrix builds as Prefect tasks: ports for an entry, its run on a fleet worker, its removal, the comparison."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from stoker.containers import engine as docker_engine
from stoker.errors import one_line
from stoker.atomic import write_atomic
from stoker.plan.matrix import Entry
from stoker.spec.schema import Ports, Spec


def free_ports() -> Ports:
    """Three ports free now, for one entry's proxy and backend roles. Chosen just before the entry runs: an
    entry's deployment lives only until the matrix is decided, so fixed ports would only collide with others'."""
    socks = [socket.socket() for _ in range(3)]
    try:
        for s in socks:  # held together, so the three differ
            s.bind(("127.0.0.1", 0))
        http, grpc, metrics = (s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()
    return Ports(http=http, grpc=grpc, metrics=metrics)


def failed_run_manifest(home: Path, deploy_name: str, since: float) -> dict | None:
    """The manifest a failed in-process entry left (its numbers up to the failure: a failed evaluation's
    perplexity, say): the newest under `home` for that deployment, written since the entry started."""
    found = []
    for path in (home / "runs").glob("*/manifest.json"):
        try:
            if path.stat().st_mtime >= since:
                m = json.loads(path.read_text())
                if m["spec"]["deploy"]["name"] == deploy_name:
                    found.append((path.stat().st_mtime, m))
        except (OSError, ValueError, KeyError):  # a run folder being written or removed: not ours
            continue
    return max(found, key=lambda f: f[0])[1] if found else None


@task(name="matrix-entry-on-worker", cache_policy=NO_CACHE, persist_result=False)
def run_on_deployment(deployment: str, spec: Spec) -> tuple[dict | None, str | None]:
    """One entry as a run of a registered build_and_deploy deployment (the fleet's workers build it); waits for it.

    Its manifest is the run's result, so that deployment's workers must persist results
    (PREFECT_RESULTS_PERSIST_BY_DEFAULT=true); otherwise the entry is recorded without numbers.
    """
    from prefect.deployments.flow_runs import run_deployment

    run = run_deployment(deployment, parameters={"spec": spec.model_dump(mode="json")},
                         flow_run_name=f"matrix-{spec.deploy.name}", as_subflow=True, tags=["stoker", "matrix"])
    state = run.state
    if not state or not state.is_completed():
        return None, f"{run.name}: {state.name if state else 'no state'} ({(state and state.message) or ''})"
    try:
        return state.result(), None
    except Exception as exc:  # noqa: BLE001 - the build completed; only its numbers are missing
        return None, f"{run.name} completed but its manifest is not retrievable ({one_line(exc)})"


@task(name="matrix-remove-entry", cache_policy=NO_CACHE, persist_result=False)
def remove_entry(spec: Spec, entry: Entry) -> list[str]:
    """Stop and remove one entry's deployment (proxy, backends, OpenAI service), as `stoker down` does."""
    logger = get_run_logger()
    client = docker_engine.connect(spec.deploy.docker_host)
    return docker_engine.remove_deployment(client, entry.deploy_name, logger.info)


@task(name="matrix-comparison", cache_policy=NO_CACHE, persist_result=False)
def publish_comparison(folder: Path, key: str, rows: list[dict], report: str, decision: dict) -> Path:
    """The comparison as files (markdown and JSON, under $STOKER_HOME/matrix/<id>/) and as Prefect artifacts."""
    write_atomic(folder / "comparison.json", json.dumps({"rows": rows, **decision}, indent=1, sort_keys=True))
    path = write_atomic(folder / "comparison.md", report)
    create_table_artifact(rows, key=f"{key}-comparison", description="matrix: one row per candidate")
    create_markdown_artifact(report, key=f"{key}-matrix", description="matrix comparison and decision")
    get_run_logger().info(f"comparison: {path}")
    return path
