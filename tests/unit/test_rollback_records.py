"""Rollback records (stoker/record/rollbacks.py): a rollback marks the build it left bad, a later rollback never
returns to it, and a pipeline run of it is refused unless forced (issue 49 item 6: "a rollback that is recorded,
sticks, and reads S3's history"). Pure rules over manifest dicts, plus the cheap S3 read the flow's check makes."""

from __future__ import annotations

import inspect
import io
import json

import pytest

from stoker.commands.rollback import RollbackError, choose, returnable_runs
from stoker.record import history, rollbacks
from stoker.spec.schema import Storage

NAME = "dep"
DONE = {"status": "completed"}


def _run(run_id: str, digest: str, spec_digest: str = "spec-1", sha: str = "c0ffee" * 6,
         switched: bool = True) -> dict:
    steps = {"upload": {**DONE, "digest": digest}, "deploy": DONE, "benchmark": DONE, "gate": DONE}
    if switched:
        steps["switch"] = DONE
    return {"run_id": run_id, "status": "completed", "steps": steps, "spec_digest": spec_digest,
            "model": {"sha": sha}, "spec": {"deploy": {"name": NAME}, "storage": {"bucket": "bkt"}}}


def _rollback(record_id: str, source: dict | None, from_digest: str, to: dict, status: str = "completed") -> dict:
    rec = rollbacks.build_record(record_id, NAME, to["spec"], source, from_digest, to, "p99 regression", status)
    return rec | {"at": f"at-{record_id}"}


A, B, C = _run("20250101T000001-aaaaaa", "a"), _run("20250101T000002-bbbbbb", "b"), _run("20250101T000003-cccccc", "c")


def test_a_rollback_record_says_what_it_left_where_it_went_and_why():
    rec = rollbacks.build_record("20250101T000004-rollback-123456", NAME, B["spec"], C, "c", B, "p99 regression",
                                 "completed", endpoint={"http": "http://127.0.0.1:9"})
    assert rec["kind"] == "rollback" and rec["status"] == "completed" and rec["reason"] == "p99 regression"
    assert rec["from"] == {"digest": "c", "run_id": C["run_id"], "spec_digest": "spec-1", "sha": "c0ffee" * 6}
    assert rec["to"] == {"digest": "b", "run_id": B["run_id"]} and rec["at"].endswith("Z")
    assert rollbacks.is_rollback_id(rollbacks.new_id()) and not rollbacks.is_rollback_id(A["run_id"])
    # Not a build to return to, and not a run `stoker cache prune` keeps as deployed.
    assert returnable_runs([A, rec], NAME) == [A]


def test_a_rollback_marks_the_build_it_left_bad_and_the_second_rollback_goes_further_back():
    r1 = _rollback("20250101T000004-rollback-111111", C, "c", B)
    every = [A, B, C, r1]
    assert set(rollbacks.bad_builds(every)) == {"c"}
    assert rollbacks.current(every) == "b"  # the build the rollback left serving, not the newest run's
    runs = returnable_runs(every, NAME)
    # B serves: the second rollback goes to A, never forward to the bad C (the old rule: newest that is not live).
    assert choose(runs, None, live_digest="b", bad=rollbacks.bad_builds(every))["run_id"] == A["run_id"]
    # Back at A, after a second rollback (B now bad too): nothing older, and the refusal says why in one line.
    r2 = _rollback("20250101T000005-rollback-222222", B, "b", A)
    every += [r2]
    assert set(rollbacks.bad_builds(every)) == {"b", "c"} and rollbacks.current(every) == "a"
    with pytest.raises(RollbackError, match="nothing older to roll back to") as err:
        choose(runs, None, live_digest="a", bad=rollbacks.bad_builds(every))
    assert "build b was rolled back at at-20250101T000005-rollback-222222" in str(err.value)
    assert "\n" not in str(err.value)
    # Asking for the bad build by run id is refused too.
    with pytest.raises(RollbackError, match=f"run {C['run_id']}'s build c was rolled back at .* by "
                                            "20250101T000004-rollback-111111"):
        choose(runs, C["run_id"], live_digest="a", bad=rollbacks.bad_builds(every))


def test_a_failed_rollback_marks_nothing():
    failed = _rollback("20250101T000004-rollback-111111", C, "c", B, status="failed")
    assert rollbacks.bad_builds([A, B, C, failed]) == {} and rollbacks.current([A, B, C, failed]) == "c"


def test_a_retrigger_of_the_rolled_back_revision_is_refused_unless_forced():
    r = _rollback("20250101T000004-rollback-111111", C, "c", B)
    every = [A, B, C, r]
    line = rollbacks.refusal(every, "spec-1", "c0ffee" * 6)
    assert line is not None and "\n" not in line
    assert "was rolled back at at-20250101T000004-rollback-111111 by 20250101T000004-rollback-111111: pass force" \
        in line and "build c" in line
    assert rollbacks.refusal(every, "spec-1", "c0ffee" * 6, force=True) is None
    assert rollbacks.refusal(every, "spec-1", "beef" * 10) is None  # a new commit of the same spec is a new build
    assert rollbacks.refusal(every, "spec-2", "c0ffee" * 6) is None  # another spec (B's, say) at the same commit
    # A forced run of it that switched clears the mark: no refusal after, and rollback may return to it again.
    forced = _run("20250101T000005-dddddd", "c")
    assert rollbacks.refusal([*every, forced], "spec-1", "c0ffee" * 6) is None
    assert rollbacks.bad_builds([*every, forced]) == {}
    # A forced run that failed before its switch clears nothing.
    failed = _run("20250101T000005-dddddd", "c", switched=False) | {"status": "failed"}
    assert rollbacks.refusal([*every, failed], "spec-1", "c0ffee" * 6) is not None


def test_the_flow_takes_force_and_stoker_run_passes_it():
    from flows.build_and_deploy import build_and_deploy
    from stoker.cli import build_parser

    assert inspect.signature(build_and_deploy.fn).parameters["force"].default is False
    assert build_parser().parse_args(["run", "s.yaml", "--force"]).force is True
    assert build_parser().parse_args(["run", "s.yaml"]).force is False


class _Bucket:
    """The two calls the check makes (list_objects_v2 pages, get_object), over a dict; counts the reads."""

    def __init__(self, objects: dict[str, dict]):
        self.objects, self.reads = objects, []

    def get_paginator(self, _op):
        return self

    def paginate(self, Bucket, Prefix):
        return [{"Contents": [{"Key": k} for k in self.objects if k.startswith(Prefix)]}]

    def get_object(self, Bucket, Key):
        self.reads.append(Key)
        return {"Body": io.BytesIO(json.dumps(self.objects[Key]).encode())}


def test_the_flows_check_reads_only_rollback_records_and_the_runs_after_them_from_s3():
    storage = Storage(bucket="bkt", prefix="p")
    root = history.runs_root(storage)
    r = _rollback("20250101T000004-rollback-111111", C, "c", B)
    later = _run("20250101T000005-dddddd", "d", spec_digest="spec-2")
    bucket = _Bucket({f"{root}{m['run_id']}/manifest.json": m for m in (A, B, C, r, later)}
                     | {f"{root}{A['run_id']}/report.md": {}})
    found = rollbacks.read_for_check(bucket, storage, local=[])
    assert sorted(m["run_id"] for m in found) == [r["run_id"], later["run_id"]]
    assert len(bucket.reads) == 2  # A, B and C, older than the rollback, were listed, never read
    assert rollbacks.refusal(found, "spec-1", "c0ffee" * 6) is not None
    # No rollback anywhere: nothing but the listing.
    quiet = _Bucket({f"{root}{m['run_id']}/manifest.json": m for m in (A, B, C)})
    assert rollbacks.read_for_check(quiet, storage, local=[]) == [] and quiet.reads == []
