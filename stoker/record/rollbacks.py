"""Rollback records: what `stoker rollback` wrote, and the rules every later decision reads from them.

A completed rollback is a run-like manifest (``kind: rollback``) stored where run manifests are
(`$STOKER_HOME/runs/<id>/manifest.json` first, then `<prefix>/runs/<id>/manifest.json` in S3). It marks the build it
rolled back FROM as bad: no later rollback returns to it, and a pipeline run of the same spec at the same model
commit is refused unless forced. A later run that switched traffic to that build (a forced one) clears the mark.
Everything here but read_for_check() is pure, over manifest dicts as S3 and $STOKER_HOME/runs hold them.
"""

from __future__ import annotations

import time
import uuid

from ..errors import StokerError

KIND = "rollback"
_ID_TAG = f"-{KIND}-"  # in the record's id, so a listing of the runs' keys names the rollbacks without reading them
EVENT = "stoker.deployment.rolled-back"


def new_id() -> str:
    """A record id that sorts among run ids by time (stoker.run.RunContext.new) and says what it is."""
    return time.strftime("%Y%m%dT%H%M%S") + _ID_TAG + uuid.uuid4().hex[:6]


def is_rollback_id(run_id: str) -> bool:
    return _ID_TAG in run_id


def is_rollback(m: dict) -> bool:
    return m.get("kind") == KIND


def build_record(record_id: str, name: str, spec: dict, from_run: dict | None, from_digest: str | None,
                 to_run: dict, reason: str, status: str, error: str | None = None,
                 endpoint: dict | None = None) -> dict:
    """The rollback's manifest: from which build (digest, the run that built it, its spec digest and model commit)
    to which run's build, why, when and how it ended. ``spec``: the spec the build rolled back to was run with (where
    a reader of this deployment's runs finds its storage). Pure."""
    src = from_run or {}
    return {
        "run_id": record_id, "kind": KIND, "status": status, "error": error, "reason": reason,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "from": {"digest": from_digest, "run_id": src.get("run_id"), "spec_digest": src.get("spec_digest"),
                 "sha": (src.get("model") or {}).get("sha")},
        "to": {"digest": to_run["steps"]["upload"]["digest"], "run_id": to_run["run_id"]},
        "endpoint": endpoint, "spec": spec,
    }


def switched_to(m: dict) -> str | None:
    """The build digest a completed run moved traffic to (or a completed rollback returned to), else None. Pure."""
    if m.get("status") != "completed":
        return None
    if is_rollback(m):
        return (m.get("to") or {}).get("digest")
    steps = m.get("steps") or {}
    if (steps.get("switch") or {}).get("status") != "completed":
        return None
    return (steps.get("upload") or {}).get("digest")


def standing(every: list[dict]) -> list[dict]:
    """The completed rollbacks still in force, oldest first: each until a later run switched to the build it rolled
    back from (by digest, or the same spec at the same commit), or a later rollback returned to it. Pure."""
    out: list[dict] = []
    for m in sorted(every, key=lambda m: m["run_id"]):
        served = switched_to(m)
        if served:
            source = None if is_rollback(m) else (m.get("spec_digest"), (m.get("model") or {}).get("sha"))
            out = [r for r in out if r["from"].get("digest") != served
                   and (source is None or (r["from"].get("spec_digest"), r["from"].get("sha")) != source)]
        if is_rollback(m) and m.get("status") == "completed":
            out.append(m)
    return out


def bad_builds(every: list[dict]) -> dict[str, dict]:
    """digest → the rollback that marked it bad, for the builds no rollback may return to. Pure."""
    return {r["from"]["digest"]: r for r in standing(every) if r["from"].get("digest")}


def current(every: list[dict]) -> str | None:
    """The digest the newest completed event (a run's switch, or a rollback) left serving, per the history. Pure."""
    for m in sorted(every, key=lambda m: m["run_id"], reverse=True):
        if served := switched_to(m):
            return served
    return None


def refusal(every: list[dict], spec_digest: str, sha: str | None, force: bool = False) -> str | None:
    """The one line that refuses a pipeline run of the spec ``spec_digest`` at model commit ``sha``: the build a
    run of it made was rolled back and has not been deployed since. None: go ahead (or ``force``). Pure."""
    if force or not sha:
        return None
    for r in reversed(standing(every)):
        src = r["from"]
        if (src.get("spec_digest"), src.get("sha")) == (spec_digest, sha):
            return (f"this spec at commit {sha[:12]} (build {str(src.get('digest'))[:12]}, run {src.get('run_id')}) "
                    f"was rolled back at {r['at']} by {r['run_id']}: pass force to deploy it again "
                    "(`stoker run --force`, or the flow's force parameter)")
    return None


def read_for_check(client, storage, local: list[dict]) -> list[dict]:
    """What refusal() needs from S3, cheaply: one listing of the runs' keys, then the rollback records and only the
    run manifests newer than the oldest rollback (what may have cleared it), each not already read here.

    Raises:
        S3Unreachable, S3Error: as stoker.record.history.list_manifests raises.
    """
    from . import history

    have = {m["run_id"] for m in local}
    keys = history.list_manifests(client, storage, skip=have)
    rollbacks = history.read_remote(client, storage, {k: v for k, v in keys.items() if is_rollback_id(k)})
    ids = [m["run_id"] for m in [*local, *rollbacks] if is_rollback(m)]
    if not ids:
        return rollbacks
    since = min(ids)
    later = {k: v for k, v in keys.items() if k > since and not is_rollback_id(k)}
    return [*rollbacks, *history.read_remote(client, storage, later)]


def emit(record: dict, name: str, log=print) -> None:
    """A Prefect event automations can match, when a Prefect API is configured; one warning line if it fails."""
    import os

    if not os.environ.get("PREFECT_API_URL"):
        return
    try:
        from prefect.events import emit_event

        emit_event(EVENT, resource={"prefect.resource.id": f"stoker.deployment.{name}", "prefect.resource.name": name},
                   payload={k: record[k] for k in ("run_id", "status", "error", "reason", "from", "to", "at")})
    except Exception as err:  # noqa: BLE001 - the record is on disk (and in S3); the event is a notification
        log(f"warning: rollback event not emitted: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")


class RolledBack(StokerError):
    """A pipeline run of a build that `stoker rollback` rolled back, without force."""
