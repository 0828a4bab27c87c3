"""The receiver's idempotency as CI uses it: a re-run signs a new timestamp under the same key and must get its
first run back; the same key with another trigger is a 409 naming that run; both hold for a restarted receiver
or another one, through Prefect's idempotency table (faked here: key → the first run)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from stoker.webhook import app as webhook_app
from stoker.webhook import signing
from stoker.webhook.app import TRIGGER_TAG, ReceiverConfig, Started, create_app, prefect_start

SECRET = b"k"
T0 = 1000.0


class FakePrefect:
    """Prefect's idempotency table: the first run created under a key is returned, not created, for every later
    start with that key, carrying what that first start tagged it with."""

    def __init__(self) -> None:
        self.table: dict[str, Started] = {}
        self.created: list[tuple[str, dict, str]] = []

    async def start(self, deployment: str, parameters: dict, key: str, identity: str) -> Started:
        if key in self.table:
            first = self.table[key]
            return Started(first.run_id, first.run_name, False, first.identity, first.revision)
        self.created.append((deployment, parameters, key))
        n = len(self.created)
        self.table[key] = Started(f"run-{n}", f"webhook-{n}", True, identity,
                                  parameters["spec"]["model"]["revision"])
        return self.table[key]


async def _ok(_spec, _deployment):
    return None


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


def _receiver(specs, prefect: FakePrefect, clock: Clock) -> TestClient:
    cfg = ReceiverConfig(secret=SECRET, specs_dir=specs, window_s=60, rate_per_s=100.0, burst=100)
    return TestClient(create_app(cfg, start_run=prefect.start, check_run=_ok, clock=clock))


@pytest.fixture
def specs(tmp_path):
    (tmp_path / "tiny.yaml").write_text("model: {repo_id: o/m}\nstorage: {bucket: b-b-b}\n")
    (tmp_path / "other.yaml").write_text("model: {repo_id: o/other}\nstorage: {bucket: b-b-b}\n")
    return tmp_path


@pytest.fixture
def prefect():
    return FakePrefect()


@pytest.fixture
def clock():
    return Clock()


def _post(client: TestClient, payload: dict, now: float = T0):
    body, headers = signing.signed_body(payload, SECRET, now=now)
    return client.post("/hooks/build", content=body, headers=headers)


TRIGGER = {"spec": "tiny", "repo": "o/m", "revision": "v2", "idempotency_key": "gha-123"}


def test_a_ci_rerun_with_a_new_timestamp_gets_its_first_run_back(specs, prefect, clock):
    client = _receiver(specs, prefect, clock)
    first = _post(client, TRIGGER)
    assert first.status_code == 202
    assert first.json()["flow_run_id"] == "run-1" and first.json()["duplicate"] is False
    clock.t = T0 + 45  # the re-run signs a later timestamp: other bytes, the same trigger
    rerun = _post(client, TRIGGER, now=T0 + 45)
    assert rerun.status_code == 202
    assert rerun.json() == {"flow_run_id": "run-1", "duplicate": True}
    assert [c[2] for c in prefect.created] == ["webhook:gha-123"]


def test_the_same_key_with_another_trigger_is_a_409_naming_the_first_run(specs, prefect, clock):
    client = _receiver(specs, prefect, clock)
    assert _post(client, TRIGGER).status_code == 202
    for other in ({**TRIGGER, "revision": "v3"}, {**TRIGGER, "spec": "other", "repo": "o/other"},
                  {**TRIGGER, "repo": None}):
        answer = _post(client, other, now=T0 + 1)
        assert answer.status_code == 409, other
        error = answer.json()["error"]
        assert "\n" not in error
        assert error.startswith("idempotency key 'gha-123' already started flow run run-1 (revision 'v2') "
                                "for another trigger; this request: ")
        assert f"spec {other['spec']!r} repo {other['repo']!r} revision {other['revision']!r}" in error
    assert len(prefect.created) == 1


def test_a_restarted_or_second_receiver_answers_the_same_through_prefects_key(specs, prefect, clock):
    assert _post(_receiver(specs, prefect, clock), TRIGGER).json()["flow_run_id"] == "run-1"
    # A new app: its memory of keys is empty, Prefect's table is not.
    clock.t = T0 + 30
    restarted = _receiver(specs, prefect, clock)
    assert _post(restarted, TRIGGER, now=T0 + 30).json() == {"flow_run_id": "run-1", "duplicate": True}
    conflict = _post(_receiver(specs, prefect, clock), {**TRIGGER, "revision": "v3"}, now=T0 + 30)
    assert conflict.status_code == 409
    assert "already started flow run run-1 (revision 'v2')" in conflict.json()["error"]
    # What Prefect answered is now remembered by the restarted receiver too.
    assert _post(restarted, {**TRIGGER, "revision": "v3"}, now=T0 + 31).status_code == 409
    assert _post(restarted, TRIGGER, now=T0 + 31).json() == {"flow_run_id": "run-1", "duplicate": True}
    assert len(prefect.created) == 1


def test_a_repeat_still_needs_a_valid_signature_and_a_fresh_timestamp(specs, prefect, clock):
    client = _receiver(specs, prefect, clock)
    assert _post(client, TRIGGER).status_code == 202
    clock.t = T0 + 100  # the first body is now outside the 60 s window
    stale = _post(client, TRIGGER, now=T0)
    assert stale.status_code == 401 and "window" in stale.json()["error"]
    body, headers = signing.signed_body(TRIGGER, b"wrong", now=T0 + 100)
    assert client.post("/hooks/build", content=body, headers=headers).status_code == 401
    assert _post(client, TRIGGER, now=T0 + 100).json() == {"flow_run_id": "run-1", "duplicate": True}


def test_without_a_key_only_a_byte_identical_resend_is_a_repeat(specs, prefect, clock):
    client = _receiver(specs, prefect, clock)
    bare = {"spec": "tiny", "revision": "v9"}
    first = _post(client, bare)
    assert first.status_code == 202 and first.json()["duplicate"] is False
    assert _post(client, bare).json() == {"flow_run_id": first.json()["flow_run_id"], "duplicate": True}
    # ... also for a restarted receiver, through Prefect's key (the body's digest).
    assert _post(_receiver(specs, prefect, clock), bare).json() == {"flow_run_id": first.json()["flow_run_id"],
                                                                   "duplicate": True}
    later = _post(client, bare, now=T0 + 1)
    assert later.status_code == 202 and later.json()["duplicate"] is False
    assert later.json()["flow_run_id"] != first.json()["flow_run_id"]
    assert len(prefect.created) == 2


def test_a_found_run_without_the_trigger_tag_answers_as_the_first_run(specs, prefect, clock):
    # Runs started before receivers tagged them: nothing to compare, so the key alone decides.
    prefect.table["webhook:gha-123"] = Started("old-run", "webhook-old", True, None, None)
    client = _receiver(specs, prefect, clock)
    assert _post(client, {**TRIGGER, "revision": "v3"}).json() == {"flow_run_id": "old-run", "duplicate": True}
    assert _post(client, TRIGGER, now=T0 + 1).json() == {"flow_run_id": "old-run", "duplicate": True}
    assert prefect.created == []


def test_prefect_start_tells_a_created_run_from_a_found_one(monkeypatch):
    calls = []
    existing = {}

    async def arun_deployment(name, *, parameters, timeout, idempotency_key, flow_run_name, as_subflow, tags):
        calls.append({"name": name, "key": idempotency_key, "flow_run_name": flow_run_name, "tags": tags,
                      "timeout": timeout, "as_subflow": as_subflow})
        if idempotency_key not in existing:  # Prefect keeps the first run's name, tags and parameters
            existing[idempotency_key] = SimpleNamespace(id=f"id-{len(existing) + 1}", name=flow_run_name,
                                                        tags=tags, parameters=parameters)
        return existing[idempotency_key]

    import prefect.deployments.flow_runs as flow_runs

    monkeypatch.setattr(flow_runs, "arun_deployment", arun_deployment)
    params = {"spec": {"model": {"repo_id": "o/m", "revision": "v2"}}}
    first = asyncio.run(prefect_start("build_and_deploy/p", params, "webhook:gha-123", "abc123"))
    assert first == Started("id-1", calls[0]["flow_run_name"], True, "abc123", "v2")
    assert f"{TRIGGER_TAG}abc123" in calls[0]["tags"] and calls[0]["timeout"] == 0
    assert calls[0]["as_subflow"] is False
    again = asyncio.run(prefect_start("build_and_deploy/p", {"spec": {"model": {"revision": "v3"}}},
                                      "webhook:gha-123", "def456"))
    assert again == Started("id-1", calls[0]["flow_run_name"], False, "abc123", "v2")
    assert calls[1]["flow_run_name"] != calls[0]["flow_run_name"]  # a nonce per start, or created could not be told


def test_trigger_identity_ignores_the_timestamp_and_the_key():
    a = webhook_app.Trigger(spec="tiny", repo="o/m", revision="v2", timestamp=1, idempotency_key="x")
    b = webhook_app.Trigger(spec="tiny", repo="o/m", revision="v2", timestamp=2)
    assert webhook_app.trigger_identity(a) == webhook_app.trigger_identity(b)
    assert webhook_app.trigger_identity(a) != webhook_app.trigger_identity(a.model_copy(update={"revision": "v3"}))
