"""build_matrix: one model revision × quantization formats (× targets) → one build_and_deploy per entry → a
comparison → the best candidate that passed every gate promoted to the spec's own deployment.

Each entry is a whole build_and_deploy (evaluation, benchmark, gates) on its own short-lived deployment
(`<name>-<format>`, free ports), as a subflow here or, with `deployment`, as a run of that registered
deployment on the fleet's workers. Promotion is one more build_and_deploy of the winner's format under the
spec's name: its heavy steps are cache hits of the entry's, and the stable endpoint moves through the usual
gated rollout. The per-entry deployments are removed at the end, whatever happened.
"""

from __future__ import annotations

import contextvars
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

from prefect import flow, get_run_logger
from pydantic import Field

from flows.build_and_deploy import build_and_deploy
from stoker.plan import matrix
from stoker.errors import one_line
from stoker.orchestration.exclusive import exclusive
from stoker.run import stoker_home
from stoker.spec.schema import Spec
from tasks.matrix import failed_run_manifest, free_ports, publish_comparison, remove_entry, run_on_deployment


@flow(name="build_matrix", log_prints=True)
def build_matrix(
    spec: Spec,
    formats: list[str],
    targets: list[str] | None = None,
    promote: bool = True,
    max_parallel: Annotated[int, Field(ge=1, le=16)] = 1,
    deployment: str | None = None,
    home: str | None = None,
) -> dict:
    """Build, evaluate and benchmark every entry; compare them; promote the best. Returns the decision.

    Args:
        spec: the model revision and every setting the entries share.
        formats: quantization formats to compare, e.g. none, fp8, int8_sq.
        targets: targets to build each format for; default: the spec's.
        promote: deploy the best candidate that passed every gate under the spec's deploy.name.
        max_parallel: entries built at once.
        deployment: FLOW/DEPLOYMENT of build_and_deploy that runs each entry on the fleet's workers; default:
            a subflow in this process.
        home: STOKER_HOME for in-process runs; default: $STOKER_HOME.
    """
    logger = get_run_logger()
    entries = matrix.plan_entries(spec, formats, targets)  # one line naming a bad entry, before any build
    matrix_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    logger.info(f"matrix {matrix_id}: {len(entries)} entries: {', '.join(e.label for e in entries)}")
    # Two matrices of one deployment name would deploy the same <name>-<format> entries: the second waits, then
    # finds every heavy step in the cache and reports the same digests.
    with exclusive(f"stoker-matrix-{spec.deploy.name}", logger.info,
                   f"another matrix of {spec.deploy.name!r} is running"):
        return _matrix(spec, entries, matrix_id, promote, max_parallel, deployment, home)


def _matrix(spec: Spec, entries: list[matrix.Entry], matrix_id: str, promote: bool, max_parallel: int,
            deployment: str | None, home: str | None) -> dict:
    logger = get_run_logger()
    best = None
    try:
        results = _run_entries(spec, entries, max_parallel, deployment, home)
        rows = [matrix.comparison_row(e, m, err) for e, (m, err) in zip(entries, results)]
        best = matrix.pick_best(rows)
        promoted, promote_error = None, None
        if promote and best:
            winner = next(e for e in entries if (e.format, e.target) == (best["format"], best["target"]))
            try:
                final = build_and_deploy.with_options(flow_run_name=f"matrix-promote-{spec.deploy.name}")(
                    matrix.entry_spec(spec, winner, spec.deploy.ports, name=spec.deploy.name), home)
                promoted = f"{winner.label} → {spec.deploy.name} ({(final.get('endpoint') or {}).get('http')})"
            except Exception as exc:  # noqa: BLE001 - the comparison still gets written
                promote_error = one_line(exc)
    finally:
        # Also after a failure: an entry's deployment outlives nothing but its comparison. Side by side, as
        # each stop may wait out a container's grace period.
        for e, removal in [(e, remove_entry.submit(spec, e)) for e in entries]:
            try:
                removal.result()
            except Exception as exc:  # noqa: BLE001 - one stuck container must not keep the others
                logger.warning(f"{e.deploy_name} not removed: {one_line(exc)}")
    decision = {"matrix_id": matrix_id, "best": best, "promoted": promoted, "promote_error": promote_error}
    report = matrix.markdown(matrix_id, spec, rows, best, promoted or (promote_error and f"failed: {promote_error}"))
    folder = (Path(home) if home else stoker_home()) / "matrix" / matrix_id
    publish_comparison(folder, f"stoker-{spec.deploy.name}", rows, report, decision)
    if promote_error:
        raise RuntimeError(f"matrix {matrix_id}: promotion of {best['format']} failed: {promote_error}")
    return {**decision, "rows": rows, "comparison": str(folder / "comparison.md")}


def _run_entries(spec: Spec, entries: list[matrix.Entry], max_parallel: int, deployment: str | None,
                 home: str | None) -> list[tuple[dict | None, str | None]]:
    """(manifest, one-line cause) per entry, in order; a failed entry never stops the others."""
    def one(entry: matrix.Entry) -> tuple[dict | None, str | None]:
        started = time.time() - 1  # file times may be coarser than the clock
        try:
            entry_spec = matrix.entry_spec(spec, entry, free_ports())
            if deployment:
                return run_on_deployment(deployment, entry_spec)
            return build_and_deploy.with_options(flow_run_name=f"matrix-{entry.deploy_name}")(entry_spec, home), None
        except Exception as exc:  # noqa: BLE001 - recorded as the entry's cause
            left = None if deployment else failed_run_manifest(Path(home) if home else stoker_home(),
                                                               entry.deploy_name, started)
            return left, one_line(exc)

    if max_parallel == 1:
        return [one(e) for e in entries]
    # Each thread runs in a copy of this flow's context, so its build_and_deploy is a subflow of this run.
    with ThreadPoolExecutor(max_workers=max_parallel) as pool:
        futures = [pool.submit(contextvars.copy_context().run, one, e) for e in entries]
        return [f.result() for f in futures]
