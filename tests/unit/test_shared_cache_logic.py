"""The shared cache's pure decisions: lease expiry, backoff, what a sweep removes, what prune selects."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from stoker.cache import lease, prune, sweep
from stoker.errors import SpecError
from stoker.spec.load import parse_spec

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "my-bucket"}}


# ---- lease expiry ----

@pytest.mark.parametrize("age, ttl, stale", [(0.0, 10, False), (10.0, 10, False), (11.0, 10, False),
                                             (11.5, 10, True), (500, 120, True), (100, 120, False)])
def test_a_lease_is_stale_only_past_its_ttl_and_a_second_of_clock_resolution(age, ttl, stale):
    assert lease.is_stale(age, ttl) is stale


def test_age_is_measured_on_the_servers_clock_not_ours():
    modified = datetime(2026, 11, 23, 12, 0, 0, tzinfo=timezone.utc)
    # Our clock is a day off; the Date header is what counts.
    assert lease.server_age_s(modified, "Mon, 23 Nov 2026 12:00:07 GMT", now=0.0) == 7.0
    assert lease.server_age_s(modified, "Mon, 23 Nov 2026 11:59:58 GMT") == 0.0  # never negative
    assert lease.server_age_s(modified, None, now=modified.timestamp() + 3) == 3.0


def test_waiters_back_off_doubling_up_to_a_quarter_of_the_ttl():
    waits = [lease.backoff_s(i, 120) for i in range(8)]
    assert waits[:3] == [0.2, 0.4, 0.8]
    assert max(waits) == 5.0 and waits == sorted(waits)
    assert lease.backoff_s(20, 2.0) == 0.5  # a short ttl polls often enough to notice it expire
    assert lease.backoff_s(0, 0.1) == 0.2


def test_lease_body_carries_holder_host_pid_and_expiry_but_not_our_view_of_it():
    body = json.loads(lease.Lease("build", "k", "h:1:ab", "h", 1, 60.0, 1000.0, etag='"x"', age_s=3).body())
    assert body == {"step": "build", "key": "k", "holder": "h:1:ab", "host": "h", "pid": 1, "ttl_s": 60.0,
                    "expires_at": 1000.0}


# ---- sweeps ----

def test_local_tmp_of_a_dead_owner_goes_after_the_short_threshold():
    dead = lambda pid: False  # noqa: E731
    alive = lambda pid: True  # noqa: E731
    mine = {"host": "h1", "pid": 42}
    assert not sweep.sweep_tmp(60, mine, "h1", dead)
    assert sweep.sweep_tmp(sweep.DEAD_OWNER_S + 1, mine, "h1", dead)
    assert not sweep.sweep_tmp(sweep.UNKNOWN_OWNER_S + 1, mine, "h1", alive)  # still working: left alone
    assert sweep.sweep_tmp(sweep.LIVE_OWNER_S + 1, mine, "h1", alive)  # a week: the pid was reused
    # Another host's folder (a shared STOKER_HOME), or one without an owner: only the long threshold.
    assert not sweep.sweep_tmp(sweep.DEAD_OWNER_S + 1, {"host": "h2", "pid": 42}, "h1", dead)
    assert not sweep.sweep_tmp(sweep.DEAD_OWNER_S + 1, None, "h1", dead)
    assert sweep.sweep_tmp(sweep.UNKNOWN_OWNER_S + 1, None, "h1", dead)


def test_remote_litter_is_markerless_and_quiet_for_longer_than_the_ttl():
    assert sweep.remote_litter(False, newest_s=100.0, now=200.0, ttl_s=60)
    assert not sweep.remote_litter(False, newest_s=180.0, now=200.0, ttl_s=60)  # a renewed lease keeps it fresh
    assert not sweep.remote_litter(True, newest_s=0.0, now=200.0, ttl_s=60)  # a complete entry is not litter


def test_a_multipart_upload_is_stale_only_without_a_live_lease_over_it():
    assert sweep.stale_upload(initiated_s=0.0, lease_modified_s=None, now=200.0, ttl_s=60)
    assert not sweep.stale_upload(initiated_s=0.0, lease_modified_s=190.0, now=200.0, ttl_s=60)  # a slow big blob
    assert sweep.stale_upload(initiated_s=0.0, lease_modified_s=100.0, now=200.0, ttl_s=60)  # its holder died
    assert not sweep.stale_upload(initiated_s=180.0, lease_modified_s=None, now=200.0, ttl_s=60)


# ---- prune selection ----

def _rows(layer="local", step="build", n=4, served=()):
    # created 100, 200, 300, 400: key k0 is the oldest
    return [prune.Row(layer, step, f"k{i}", 10, 100.0 * (i + 1), f"d{i}", served=f"k{i}" in served)
            for i in range(n)]


def test_keep_last_keeps_the_newest_per_step_and_layer():
    rows = _rows() + _rows(step="fetch", n=2) + _rows(layer="remote", n=1)
    gone = prune.select(rows, now=1000, older_than_s=None, keep_last=2)
    assert {(r.layer, r.step, r.key) for r in gone} == {("local", "build", "k0"), ("local", "build", "k1")}


def test_older_than_and_keep_last_must_both_allow_a_removal():
    gone = prune.select(_rows(), now=1000, older_than_s=750, keep_last=None)  # ages 900, 800, 700, 600
    assert [r.key for r in gone] == ["k1", "k0"]
    gone = prune.select(_rows(), now=1000, older_than_s=650, keep_last=3)
    assert [r.key for r in gone] == ["k0"]


def test_a_served_entry_is_never_selected_and_counts_among_the_newest():
    rows = _rows(served=("k0",))
    gone = prune.select(rows, now=10_000, older_than_s=0, keep_last=0)
    assert [r.key for r in gone] == ["k3", "k2", "k1"]
    gone = prune.select(_rows(served=("k3",)), now=10_000, older_than_s=None, keep_last=1)
    assert [r.key for r in gone] == ["k2", "k1", "k0"]


def test_prune_needs_a_rule():
    with pytest.raises(ValueError, match="--older-than and/or --keep-last"):
        prune.select(_rows(), now=0, older_than_s=None, keep_last=None)


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800),
                                           ("1w", 604800), ("0.5h", 1800)])
def test_ages_parse(text, seconds):
    assert prune.parse_age(text) == seconds


@pytest.mark.parametrize("text", ["soon", "7y", "", "-3d"])
def test_bad_ages_say_what_is_expected(text):
    with pytest.raises(ValueError, match="--older-than"):
        prune.parse_age(text)


def _manifest(home, run_id, name, digest, keys, rolled_back=False):
    m = {"run_id": run_id, "spec": {"deploy": {"name": name}, "storage": {"bucket": "b-1"}},
         "steps": {"fetch": {"status": "completed", "key": keys[0]}, "build": {"status": "completed", "key": keys[1]},
                   "upload": {"status": "completed", "key": digest[:24], "digest": digest},
                   "deploy": {"status": "completed", "key": None}},
         "rollback": {"status": "rolled back"} if rolled_back else None}
    (home / "runs" / run_id).mkdir(parents=True)
    (home / "runs" / run_id / "manifest.json").write_text(json.dumps(m))


def test_served_protects_the_newest_deployed_run_and_what_docker_and_s3_report(tmp_path):
    _manifest(tmp_path, "20261101T000000-aaaaaa", "chat", "d-old", ["f1", "b-old"])
    _manifest(tmp_path, "20261102T000000-bbbbbb", "chat", "d-new", ["f1", "b-new"])
    _manifest(tmp_path, "20261103T000000-cccccc", "chat", "d-back", ["f1", "b-back"], rolled_back=True)
    found = prune.served(tmp_path, docker_live=lambda n: "d-old", s3_live=lambda s, n: None)
    assert found.digests == {"d-new", "d-old"}
    assert found.keys == {("fetch", "f1"), ("build", "b-new"), ("build", "b-old")}
    assert found.covers(prune.Row("remote", "package", "pk", 1, 0.0, "d-new"))  # by digest, no manifest needed
    assert not found.covers(prune.Row("local", "build", "b-back", 1, 0.0, "d-back"))


def test_a_source_that_cannot_be_asked_is_a_note_and_the_manifests_still_protect(tmp_path):
    _manifest(tmp_path, "20261102T000000-bbbbbb", "chat", "d-new", ["f1", "b-new"])

    def down(*_):
        raise ConnectionError("no daemon")

    found = prune.served(tmp_path, docker_live=down, s3_live=lambda s, n: "live-123")  # a stand-in, not a digest
    assert found.digests == {"d-new"}
    assert found.notes == ["chat: Docker not asked (ConnectionError: no daemon)"]


# ---- the spec switch ----

def test_shared_cache_is_off_by_default_and_leaves_dumps_as_they_were():
    spec = parse_spec(BASE)
    assert spec.storage.shared_cache is False
    assert "shared_cache" not in spec.model_dump(mode="json")["storage"]
    assert "cache_lease_s" not in spec.model_dump(mode="json")["storage"]
    on = parse_spec({**BASE, "storage": {"bucket": "my-bucket", "shared_cache": True, "cache_lease_s": 30}})
    assert on.storage.model_dump(mode="json")["shared_cache"] is True
    assert parse_spec(on.model_dump(mode="json")).storage == on.storage  # a manifest's spec reads back
    assert on.digest() != spec.digest()


@pytest.mark.parametrize("value, message", [
    ("maybe", "storage.shared_cache: must be true or false, not 'maybe'"),
    (1, "storage.shared_cache: must be true or false, not 1"),
])
def test_a_bad_shared_cache_value_is_one_line(value, message):
    with pytest.raises(SpecError) as exc:
        parse_spec({**BASE, "storage": {"bucket": "my-bucket", "shared_cache": value}}, "s.yaml")
    assert str(exc.value) == f"s.yaml: {message}"


def test_a_lease_shorter_than_two_seconds_is_refused():
    with pytest.raises(SpecError, match="storage.cache_lease_s"):
        parse_spec({**BASE, "storage": {"bucket": "my-bucket", "cache_lease_s": 0.5}})
