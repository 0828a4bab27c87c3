"""What `stoker prune` keeps (stoker/record/retention.py, issue 49 item 8: bounded growth): the live build, its
rollback targets, the N newest runs and standing rollback records stay; older run records and the builds only they
named go; what no manifest explains yet stays through the grace period. Pure rules over manifest dicts."""

from __future__ import annotations

import pytest

from stoker.record import retention
from stoker.record import rollbacks
from stoker.record.retention import Item

DONE = {"status": "completed"}
DAY = 86400.0
NOW = 100 * DAY


def _digest(i: int, name: str = "dep") -> str:
    return f"{name}{i:03d}".ljust(64, "0")


def _run(i: int, name: str = "dep", switched: bool = True, status: str = "completed", digest: str | None = None):
    steps = {"upload": {**DONE, "digest": digest or _digest(i, name)}, "deploy": DONE, "gate": DONE}
    if switched:
        steps["switch"] = DONE
    else:
        steps["gate"] = {"status": "failed"}
    return {"run_id": f"202501{i:02d}T000000-{name}", "status": status, "steps": steps, "spec_digest": f"s{i}",
            "model": {"sha": f"sha{i}"}, "spec": {"deploy": {"name": name}, "storage": {"bucket": "bkt"}}}


def _run_item(m: dict, where: str = "s3", newest: float = 0.0) -> Item:
    return Item(where, "run", m["run_id"], f"{where}:runs/{m['run_id']}/", 100, 2, newest)


def _repo_item(digest: str, newest: float = 0.0, where: str = "s3") -> Item:
    d = digest[:retention.DIGEST_CHARS]
    return Item(where, "repo", d, f"{where}:repos/{d}/", 1000, 5, newest)


def _removed(plan, kind: str) -> set[str]:
    return {i.ident for i in plan.remove if i.kind == kind}


def test_twelve_builds_keep_the_live_one_two_rollback_targets_and_the_two_newest_runs():
    runs = [_run(i) for i in range(1, 13)]
    # Written a minute ago: the grace period spares only what no run recorded, not the old runs' builds.
    items = [_run_item(m, newest=NOW - 60) for m in runs] + [_repo_item(_digest(i), NOW - 60) for i in range(1, 13)]
    plan = retention.plan(runs, items, {}, keep=2, now=NOW)
    kept_ids = {runs[i]["run_id"] for i in (9, 10, 11)}  # run 12 serves; 11 and 10 are the two rollback targets
    assert _removed(plan, "run") == {m["run_id"] for m in runs} - kept_ids
    assert _removed(plan, "repo") == {_digest(i)[:24] for i in range(1, 10)}
    assert "live build" in plan.kept[f"s3 run {runs[11]['run_id']}"]
    assert plan.kept[f"s3 run {runs[9]['run_id']}"] == "dep: rollback target"
    assert plan.bytes == 9 * 100 + 9 * 1000 and plan.objects == 9 * 2 + 9 * 5


def test_what_a_container_serves_or_the_live_repository_names_stays_whatever_its_age():
    runs = [_run(i) for i in range(1, 8)]
    items = [_repo_item(_digest(i)) for i in range(1, 8)]
    protected = {_digest(2): "container stoker-dep-blue is labelled with it", _digest(3)[:24]: "live repository"}
    plan = retention.plan(runs, items, protected, keep=1, now=NOW)
    assert _removed(plan, "repo") == {_digest(i)[:24] for i in (1, 4, 5)}
    assert plan.kept[f"s3 repo {_digest(2)[:24]}"].startswith("container")


def test_a_rolled_back_build_is_no_target_and_the_standing_record_outlives_the_newest_runs():
    runs = [_run(i) for i in range(1, 6)]
    record = rollbacks.build_record("20250106T000000-rollback-abcdef", "dep", runs[3]["spec"], runs[4], _digest(5),
                                    runs[3], "p99", "completed")
    later = [_run(i, switched=False, status="failed") for i in range(7, 10)]  # failed candidates after the rollback
    every = runs + [record] + later
    plan = retention.plan(every, [_run_item(m) for m in every] + [_repo_item(_digest(i)) for i in range(1, 10)],
                          {}, keep=2, now=NOW)
    # Serving: build 4 (the rollback's target). Rollback targets: 3 and 2, never 5 (marked bad). Newest two: 8, 9.
    kept = {m["run_id"] for m in every} - _removed(plan, "run")
    assert kept == {runs[3]["run_id"], runs[2]["run_id"], runs[1]["run_id"], record["run_id"],
                    later[1]["run_id"], later[2]["run_id"]}
    assert plan.kept[f"s3 run {record['run_id']}"] == "dep: rollback record in force"
    assert _digest(5)[:24] in _removed(plan, "repo")  # the bad build's repository goes; its record stays


def test_a_build_another_deployment_still_keeps_stays():
    shared = _digest(99, "both")
    runs = [_run(1, digest=shared), _run(2), _run(3), _run(1, "other", digest=shared)]
    plan = retention.plan(runs, [_repo_item(shared), _repo_item(_digest(2))], {}, keep=0, now=NOW)
    assert _removed(plan, "repo") == {_digest(2)[:24]}  # dep serves 3; "other" serves the shared build


def test_what_no_manifest_explains_stays_through_the_grace_period_then_goes():
    runs = [_run(1)]
    orphan_young, orphan_old = _repo_item(_digest(50), newest=NOW - 60), _repo_item(_digest(51), newest=NOW - 2 * DAY)
    unrecorded_young = Item("s3", "run", "20250199T000000-inflight", "s3:runs/x/", 10, 1, NOW - 60, complete=False)
    unrecorded_old = Item("local", "run", "20250100T000000-killed", "/h/runs/y", 10, 1, NOW - 2 * DAY, complete=False)
    plan = retention.plan(runs, [orphan_young, orphan_old, unrecorded_young, unrecorded_old], {}, keep=5, now=NOW)
    assert {i.ident for i in plan.remove} == {orphan_old.ident, unrecorded_old.ident}
    assert "grace" in plan.kept[f"s3 repo {orphan_young.ident}"]


def test_keep_zero_keeps_only_what_serves_and_a_manifest_of_unknown_shape_is_never_judged():
    runs = [_run(i) for i in range(1, 4)]
    odd = {"run_id": "20250110T000000-odd", "status": "completed"}
    plan = retention.plan([*runs, odd], [_run_item(m) for m in [*runs, odd]], {}, keep=0, now=NOW)
    assert _removed(plan, "run") == {runs[0]["run_id"], runs[1]["run_id"]}
    assert plan.kept["s3 run 20250110T000000-odd"] == "no deployment named in it"
    with pytest.raises(ValueError, match="--keep"):
        retention.plan(runs, [], {}, keep=-1)


def test_openai_state_drops_the_indexes_of_gone_containers_and_assets_nothing_names():
    assets = [Item("local", "assets", k, f"/s/assets/{k}", 10, 1, t)
              for k, t in (("live", 0), ("prev", 0), ("orphan", 0), ("fresh", NOW - 60))]
    indexes = {"aaaa": "prev", "bbbb": "orphan", "cccc": None}
    gone, doomed = retention.openai_litter(indexes, {"live"}, {"aaaa1234", "zzzz"}, assets, NOW)
    assert gone == ["bbbb", "cccc"]
    assert [a.ident for a in doomed] == ["orphan"]  # "fresh": a prefetch may be about to write its index


def test_state_size_counts_every_folder_of_the_home(tmp_path):
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "manifest.json").write_bytes(b"x" * 10)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "blob").write_bytes(b"y" * 5)
    size = retention.state_size(tmp_path)
    assert size["home_bytes"] == 15 and size["home_files"] == 2
    assert size["home_by_folder"] == {"cache": {"bytes": 5, "files": 1}, "runs": {"bytes": 10, "files": 1}}
    assert size["s3"] == []


def test_bad_arguments_fail_in_one_line_before_anything_is_asked(monkeypatch, tmp_path):
    from argparse import Namespace

    from stoker.commands import prune

    monkeypatch.setenv("STOKER_HOME", str(tmp_path))
    monkeypatch.setattr(prune, "gather", lambda *a, **k: pytest.fail("observed before the arguments were checked"))
    for keep, grace, cause in ((-1, None, "--keep -1: must be 0 or more"), (5, "soon", "--grace 'soon': expected")):
        with pytest.raises(prune.PruneError) as err:
            prune.prune_cmd(Namespace(keep=keep, grace=grace, spec=None, dry_run=True, verbose=False))
        assert str(err.value).startswith(cause) and "\n" not in str(err.value)
