"""`stoker rollback`'s history: which builds count (pure, over manifest dicts as S3 and $STOKER_HOME/runs hold them),
how S3's run folders are read and merged with local ones, and the one-line failures (S3 unreachable, a folder that
no longer holds the recorded build)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from stoker.commands import rollback
from stoker.commands.rollback import RollbackError, choose, returnable_runs
from stoker.demo import DEMO_SPEC
from stoker.record import history
from stoker.serving import mounted_repository
from stoker.spec.load import parse_spec
from stoker.spec.schema import Storage
from stoker.storage.digest import records_digest, tree_records
from stoker.storage.s3 import S3Unreachable

NAME = "dep"
DONE = {"status": "completed"}


def _manifest(run_id: str, digest: str, name: str = NAME, status: str = "completed", switched: bool = True,
              gate: str | None = "completed", rollback_status: str | None = None, bucket: str = "bkt",
              endpoint: str | None = None) -> dict:
    steps = {"upload": {**DONE, "digest": digest}, "deploy": DONE}
    if gate:
        steps |= {"benchmark": DONE, "gate": {"status": gate}}
    if switched:
        steps["switch"] = DONE
    return {"run_id": run_id, "status": status, "steps": steps,
            "rollback": {"status": rollback_status} if rollback_status else None,
            "spec": {"deploy": {"name": name}, "storage": {"bucket": bucket, "endpoint_url": endpoint}}}


def test_a_build_counts_only_when_its_run_completed_passed_its_gates_and_switched():
    good = _manifest("20250101T000001-a", "a")
    runs = [
        good,
        _manifest("20250101T000002-b", "b", status="failed", gate="failed", switched=False,
                  rollback_status="rolled back"),  # a gate failed: the candidate was removed
        _manifest("20250101T000003-c", "c", switched=False, gate=None),  # cancelled while gated: recorded completed
        _manifest("20250101T000004-d", "d", status="failed"),  # switched, then the run failed (promote)
        _manifest("20250101T000005-e", "e", gate=None),  # no gate in its record: never proven
        _manifest("20250101T000006-f", "f", name="other"),  # another deployment
    ]
    assert [m["run_id"] for m in returnable_runs(runs, NAME)] == [good["run_id"]]


def test_the_previous_good_build_is_chosen_from_manifests_listed_in_s3_with_no_local_runs():
    # The layout a bucket holds after three runs of NAME and one of another deployment (tasks/s3.py store_manifest),
    # beside each run's other files; this host's runs/ is gone.
    root = history.runs_root(Storage(bucket="bkt", prefix="team/stoker"))
    assert root == "team/stoker/runs/"
    objects = {
        "20250101T000001-a": _manifest("20250101T000001-a", "a"),
        "20250101T000002-b": _manifest("20250101T000002-b", "b"),  # serves now
        # newest: staged, killed before its gate ended (no switch, no rollback record); the old rule took it
        "20250101T000003-c": _manifest("20250101T000003-c", "c", status="failed", switched=False, gate=None),
        "20250101T000004-x": _manifest("20250101T000004-x", "x", name="other"),
    }
    keys = [f"{root}{rid}/{f}" for rid in objects for f in ("manifest.json", "report.md", "evaluation.json")]
    keys += [f"{root}nested/deeper/manifest.json", "team/stoker/repos/abc/stoker-repo.json", f"{root}manifest.json"]
    listed = history.manifest_keys(keys, root, skip=set())
    assert listed == {rid: f"{root}{rid}/manifest.json" for rid in objects}
    every = history.merge([], [objects[rid] for rid in listed])
    chosen = choose(returnable_runs(every, NAME), None, live_digest="b")
    assert chosen["run_id"] == "20250101T000001-a"
    # Only the live build passed its gates and switched: nothing to go back to.
    with pytest.raises(RollbackError, match="nothing older to roll back to"):
        choose(returnable_runs([objects["20250101T000002-b"], objects["20250101T000003-c"]], NAME), None, "b")


def test_local_and_s3_manifests_merge_one_per_run_oldest_first_local_copy_winning():
    local = [_manifest("20250101T000002-b", "b-local")]
    remote = [_manifest("20250101T000003-c", "c"), _manifest("20250101T000002-b", "b-s3"),
              _manifest("20250101T000001-a", "a")]
    merged = history.merge(local, remote)
    assert [m["run_id"] for m in merged] == ["20250101T000001-a", "20250101T000002-b", "20250101T000003-c"]
    assert merged[1]["steps"]["upload"]["digest"] == "b-local"
    # Run ids already read here are not fetched again.
    root = "p/runs/"
    keys = [f"{root}20250101T000002-b/manifest.json", f"{root}20250101T000003-c/manifest.json"]
    assert history.manifest_keys(keys, root, skip={"20250101T000002-b"}) == {"20250101T000003-c": keys[1]}


def test_the_buckets_read_are_those_the_local_runs_of_the_deployment_name_and_the_given_specs():
    local = [_manifest("1", "a", bucket="old"), _manifest("2", "b", bucket="new"), _manifest("3", "c", bucket="new"),
             _manifest("4", "d", bucket="theirs", name="other"), {"run_id": "5", "spec": {"deploy": {"name": NAME}}}]
    assert [s.bucket for s in history.storages_of(local, NAME)] == ["new", "old"]
    given = yaml.safe_load(DEMO_SPEC.read_text())
    given["storage"]["bucket"] = "given"
    assert [s.bucket for s in history.storages_of([], NAME, parse_spec(given))] == ["given"]
    assert [s.bucket for s in history.storages_of(local, NAME, parse_spec(given))] == ["new", "old", "given"]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable_s3(monkeypatch) -> str:
    """An endpoint nothing listens on (a real refusal, no mock), tried once, with keys so that boto3 signs."""
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    return f"http://127.0.0.1:{_closed_port()}"


def test_s3_unreachable_is_one_line_naming_the_runs_it_could_not_read(tmp_path, unreachable_s3):
    run = tmp_path / "runs" / "20250101T000001-a"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps(_manifest(run.name, "a", bucket="bkt", endpoint=unreachable_s3)))
    with pytest.raises(RollbackError) as err:
        rollback.history(NAME, tmp_path)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1, msg
    assert "cannot read the runs of dep in S3, nothing changed" in msg and "s3://bkt/stoker/runs/" in msg, msg
    assert f"{unreachable_s3} is unreachable" in msg, msg


def _package_folder(root: Path) -> tuple[Path, str]:
    (root / "tensorrt_llm" / "1" / "engine").mkdir(parents=True)
    (root / "tensorrt_llm" / "config.pbtxt").write_text('backend: "tensorrtllm"\n')
    (root / "tensorrt_llm" / "1" / "engine" / "rank0.engine").write_bytes(b"\0" * 64)
    return root, records_digest(tree_records(root))


def test_a_package_folder_that_still_holds_the_build_is_mounted_without_asking_s3(tmp_path):
    folder, digest = _package_folder(tmp_path / "cache" / "package" / "k" / "out")
    storage = Storage(bucket="bkt", endpoint_url="http://127.0.0.1:9")  # never asked
    got, source = mounted_repository.local_copy(storage, digest, folder, tmp_path, print)
    assert got == folder and source == f"the package step's folder {folder}"


def test_a_changed_or_pruned_package_folder_goes_to_s3_and_a_failure_there_leaves_nothing(tmp_path, unreachable_s3):
    folder, digest = _package_folder(tmp_path / "cache" / "package" / "k" / "out")
    (folder / "tensorrt_llm" / "1" / "engine" / "rank0.engine").write_bytes(b"\1" * 64)  # same size, other bytes
    assert not mounted_repository.matches(folder, digest)
    storage = Storage(bucket="bkt", endpoint_url=unreachable_s3)
    for package in (folder, tmp_path / "pruned"):
        with pytest.raises(S3Unreachable, match="is unreachable") as err:
            mounted_repository.local_copy(storage, digest, package, tmp_path, print)
        assert len(str(err.value).splitlines()) == 1
    fetched = tmp_path / mounted_repository.FOLDER
    assert not fetched.exists() or not any(fetched.iterdir())


def test_a_fetched_repository_gets_back_the_empty_version_folders_its_upload_could_not_carry():
    files = ["ensemble/config.pbtxt", "preprocessing/config.pbtxt", "preprocessing/1/model.py",
             "tensorrt_llm/config.pbtxt", "tensorrt_llm/1/engine/rank0.engine", "stoker_limits.json"]
    assert mounted_repository.version_folders(files, []) == ["ensemble/1"]  # a GPU upload records no empty folder
    assert mounted_repository.version_folders(files, ["ensemble/1"]) == []  # the reference package records it


def test_cache_prune_keeps_a_build_that_kept_serving_when_its_old_backend_was_dead(tmp_path):
    # The watch failed, but the old backend was dead: the new build kept serving (PromotionFailed.status "kept").
    kept = _manifest("20250101T000001-k", "k", status="failed", rollback_status="kept")
    kept["steps"]["switch"] = {"status": "failed"}
    back = _manifest("20250101T000002-r", "r", status="failed", rollback_status="rolled back")
    back["steps"]["switch"] = {"status": "failed"}
    for m in (kept, back):
        folder = tmp_path / "runs" / m["run_id"]
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps(m))
    assert [m["run_id"] for m in rollback.deployed_runs(tmp_path, NAME)] == [kept["run_id"]]
    assert returnable_runs([kept, back], NAME) == []  # never a rollback target: its watch failed
