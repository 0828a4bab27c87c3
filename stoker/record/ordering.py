"""Runs of one deployment take effect in the order they started, not the order they finish. Pure.

The deploy lock lets one run at a time stage and switch, but not in order: a run started earlier (an older
revision, a slower build) that reaches the lock last would replace the build of a run started after it. So at
deploy, under the lock, a run whose start is older than the start of the run whose build serves is refused in one
line, unless forced (`stoker run --force`, the flow's ``force``).

A run's start is its run id's stamp (stoker.run.RunContext.new, taken as the flow starts; every backend carries
its run's id as a label, stoker.containers.engine.LABEL_RUN), so what runs is the record: nothing else to keep
in step. The stamp is the host's local time to the second: runs that started in the same second are not ordered
(both pass), and hosts deploying one name must share a time zone.
"""

from __future__ import annotations

import re

_STAMP = re.compile(r"^(\d{8}T\d{6})")


def started(run_id: str | None) -> str | None:
    """``YYYYmmddTHHMMSS`` of a run id (sorts as time), None for an id that has none (not a stoker run)."""
    m = _STAMP.match(run_id or "")
    return m.group(1) if m else None


def refusal(name: str, run_id: str, serving_run: str | None, serving_digest: str | None,
            force: bool = False, digest: str | None = None) -> str | None:
    """The one line refusing run ``run_id`` (of build ``digest``) of deployment ``name`` because the build serving
    now came from a run that started after it; None when it may deploy. The same build serving replaces nothing."""
    if force or not serving_run or serving_run == run_id or (digest and digest == serving_digest):
        return None
    mine, theirs = started(run_id), started(serving_run)
    if mine is None or theirs is None or mine >= theirs:
        return None
    return (f"run {run_id} started before run {serving_run}, whose build {(serving_digest or '?')[:12]} serves "
            f"{name}: an older run does not replace a newer one; pass force (stoker run --force) to deploy it anyway")
