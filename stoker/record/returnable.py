"""Which earlier builds a deployment may go back to, and which one (`stoker rollback`, and per host a fleet's
rollback): over run manifests as S3 and $STOKER_HOME/runs hold them. Pure."""

from __future__ import annotations

from ..errors import StokerError
from . import rollbacks


class RollbackError(StokerError):
    """No earlier run to return to, an unknown deployment, or the way back failed."""


# Steps a build must have completed to be returned to: uploaded, staged, gated, and traffic moved to it.
REQUIRED_STEPS = ("upload", "deploy", "gate", "switch")
# What judges a candidate before the switch, when the run had it: every one of them passed.
GATE_STEPS = ("benchmark", "evaluate", "gate")


def returnable(m: dict, name: str) -> bool:
    """Whether run manifest ``m`` is a build of ``name`` to go back to: the run completed, every gate it ran passed,
    and traffic switched to it. A candidate that was staged and never switched (a failed gate, a cancelled or killed
    run) never counts: it was never proven to serve. Pure."""
    steps = m.get("steps") or {}
    if ((m.get("spec") or {}).get("deploy") or {}).get("name") != name or m.get("status") != "completed":
        return False
    if (m.get("rollback") or {}).get("status") == "rolled back":
        return False
    if not all((steps.get(s) or {}).get("status") == "completed" for s in REQUIRED_STEPS):
        return False
    if any((steps.get(s) or {}).get("status") not in (None, "completed") for s in GATE_STEPS):
        return False
    return bool((steps.get("upload") or {}).get("digest"))


def returnable_runs(manifests: list[dict], name: str) -> list[dict]:
    """The returnable builds of ``name`` among ``manifests``, oldest first. Pure."""
    return sorted((m for m in manifests if returnable(m, name)), key=lambda m: m["run_id"])


def choose(runs: list[dict], run_id: str | None, live_digest: str | None, bad: dict[str, dict] | None = None,
           anchor: str | None = None) -> dict:
    """The manifest to return to: RUN_ID's, or the newest run older than the newest one of what serves (``anchor``,
    by default the live digest) whose build neither serves nor was rolled back (``bad``: digest → the rollback
    record that marked it, stoker.record.rollbacks.bad_builds). Pure."""
    bad = bad or {}
    if run_id:
        for m in runs:
            if m["run_id"] == run_id:
                digest = m["steps"]["upload"]["digest"]
                if digest == live_digest:
                    raise RollbackError(f"run {run_id} deployed digest {live_digest[:12]}, which already serves")
                if digest in bad:
                    raise RollbackError(f"run {run_id}'s build {digest[:12]} {_marked(bad[digest])}: rollback does "
                                        "not return to it (a run of its spec with force deploys it again)")
                return m
        raise RollbackError(f"run {run_id} did not deploy this deployment (or its manifest is neither here nor in S3)")
    # A rollback goes back: never forward past what serves to a build an earlier rollback skipped.
    anchor = anchor or live_digest
    serving = [i for i, m in enumerate(runs) if m["steps"]["upload"]["digest"] == anchor]
    older = runs[:serving[-1]] if serving else runs
    for m in reversed(older):
        if m["steps"]["upload"]["digest"] not in (live_digest, anchor) and m["steps"]["upload"]["digest"] not in bad:
            return m
    skipped = {m["steps"]["upload"]["digest"] for m in runs} & set(bad)  # why a newer build is no way back either
    raise RollbackError("nothing older to roll back to: no earlier run deployed anything else"
                        + "".join(f"; build {d[:12]} {_marked(bad[d])}" for d in sorted(skipped)))


def fleet_plan(every: list[dict], name: str, serving: dict[str, str | None], to_run: str | None) -> dict[str, dict]:
    """Per fleet host (``serving``: host → the digest it serves now), the host run to go back to, among that host's
    own runs in ``every`` (manifests with its `fleet_host`): its part of fleet run ``to_run`` (`<to_run>-<host>`;
    a host already serving that build is skipped), else choose()'s. Decided for every host before any changes: a
    host with nowhere to go raises RollbackError naming it. Pure."""
    bad = rollbacks.bad_builds(every)
    plan = {}
    for host, digest in serving.items():
        runs = [m for m in returnable_runs(every, name) if m.get("fleet_host") == host]
        wanted = f"{to_run}-{host}" if to_run else None
        mine = next((m for m in runs if m["run_id"] == wanted), None)
        if mine is not None and mine["steps"]["upload"]["digest"] == digest:
            plan[host] = {"before": digest, "to_run": wanted, "to": digest, "skip": True}
            continue
        if digest is None and not wanted:
            raise RollbackError(f"fleet rollback: host {host!r} serves nothing: name the fleet run to go back to "
                                "(--to); nothing changed")
        try:
            chosen = choose(runs, wanted, digest, bad)
        except RollbackError as err:
            raise RollbackError(f"fleet rollback: host {host!r}: {err}; nothing changed") from None
        plan[host] = {"before": digest, "to_run": chosen["run_id"], "to": chosen["steps"]["upload"]["digest"],
                      "skip": False}
    return plan


def _marked(record: dict) -> str:
    return f"was rolled back at {record['at']} by {record['run_id']}"
