"""Pure parts of operating stoker: webhook signing/limits, Triton metrics parsing, live-repo key mapping,
rollback target choice, the report's rollback section, the receiver's answers (with an injected starter)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from stoker.commands.rollback import RollbackError, choose
from stoker.record.report import markdown
from stoker.deploy.rollout import version_key
from stoker.triton.metrics import parse, summarize
from stoker.webhook import signing
from stoker.webhook.app import ReceiverConfig, Refused, Started, create_app


def test_sign_matches_github_format_and_verify_is_strict():
    body = b'{"spec":"x","revision":"main","timestamp":1}'
    # openssl dgst -sha256 -hmac s3cret (what the example CI workflow runs)
    assert signing.sign(b"s3cret", body) == "sha256=79859b38acff038e99a5ded4e9f98e1f9494049d8dd6dc506201391d4a034373"
    assert signing.verify(b"s3cret", body, signing.sign(b"s3cret", body))
    assert not signing.verify(b"s3cret", body + b" ", signing.sign(b"s3cret", body))
    assert not signing.verify(b"s3cret", body, None) and not signing.verify(b"s3cret", body, "md5=00")


def test_window_bucket_and_seen_keys():
    assert signing.within_window(100, 399, 300) and not signing.within_window(100, 401, 300)
    bucket = signing.TokenBucket(rate=1.0, burst=2)
    assert [bucket.allow("a", 0.0) for _ in range(3)] == [True, True, False]
    assert bucket.allow("b", 0.0) and bucket.allow("a", 1.0)
    seen = signing.SeenKeys(ttl_s=10)
    seen.put("k", ("d", "run"), now=0)
    assert seen.get("k", 5) == ("d", "run") and seen.get("k", 11) is None



def test_the_rate_map_stays_bounded_under_a_flood_of_addresses_and_still_limits():
    bucket = signing.TokenBucket(rate=1.0, burst=2, max_keys=100)
    assert [bucket.allow("steady", 0.0) for _ in range(3)] == [True, True, False]
    for i in range(5_000):  # one request each from 5,000 addresses within a second
        assert bucket.allow(f"10.0.{i // 256}.{i % 256}", 0.5)
    assert len(bucket._state) <= 100
    assert bucket.allow("new", 0.6) and bucket.allow("new", 0.6) and not bucket.allow("new", 0.6)
    # Long after, a sweep forgets every refilled bucket.
    for i in range(100):
        bucket.allow(f"later-{i}", 1000.0)
    assert len(bucket._state) <= 100 and "steady" not in bucket._state


METRICS = """# HELP nv_inference_request_success Number of successful inference requests
nv_inference_request_success{model="ensemble",version="1"} 10
nv_inference_request_failure{model="ensemble",version="1"} 2
nv_inference_queue_duration_us{model="tensorrt_llm",version="1"} 3000
nv_inference_queue_duration_us{model="tensorrt_llm",version="2"} 1000
nv_inference_request_success{model="tensorrt_llm",version="1"} 3
nv_inference_request_success{model="tensorrt_llm",version="2"} 1
nv_inference_compute_infer_duration_us{model="tensorrt_llm",version="1"} 40000
nv_gpu_utilization{gpu_uuid="x"} 0.5
"""


def test_metrics_parse_sums_versions_and_summarizes_with_units():
    rows = {r["model"]: r for r in summarize(parse(METRICS))}
    assert rows["ensemble"] == {"model": "ensemble", "requests": 12, "failed": 2, "executions": 0,
                                "mean_queue_ms": 0.0, "mean_compute_ms": 0.0, "mean_request_ms": 0.0}
    assert rows["tensorrt_llm"]["requests"] == 4
    assert rows["tensorrt_llm"]["mean_queue_ms"] == 1.0 and rows["tensorrt_llm"]["mean_compute_ms"] == 10.0


def test_version_key_maps_build_layout_into_the_live_version():
    src, dst = "p/repos/abc/model_repository", "p/live/n/model_repository"
    assert version_key(f"{src}/tensorrt_llm/1/weights/a.safetensors", src, dst, 7) == \
        f"{dst}/tensorrt_llm/7/weights/a.safetensors"
    assert version_key(f"{src}/ensemble/1/", src, dst, 2) == f"{dst}/ensemble/2/"
    assert version_key(f"{src}/ensemble/config.pbtxt", src, dst, 2) == f"{dst}/ensemble/config.pbtxt"
    assert version_key("p/repos/abc/stoker-repo.json", src, dst, 2) is None


def _run(run_id, digest):
    return {"run_id": run_id, "steps": {"upload": {"digest": digest}}}


def test_rollback_choice():
    runs = [_run("1", "a"), _run("2", "b"), _run("3", "b")]
    assert choose(runs, None, "b")["run_id"] == "1"
    assert choose(runs, "2", "a")["run_id"] == "2"
    with pytest.raises(RollbackError):
        choose(runs, "9", "a")
    with pytest.raises(RollbackError):
        choose([_run("1", "a")], None, "a")


def test_report_shows_rollback_and_metrics():
    m = {"run_id": "r", "status": "failed", "error": "RuntimeError: gate", "spec_digest": "0" * 64,
         "spec": {"quantization": {"format": "none", "kv_cache_dtype": "none"}, "target": "reference"},
         "model": {"repo_id": "o/m", "revision": "main", "sha": "s", "local_path": None}, "endpoint": None,
         "wall_s": 1.0, "overhead_s": 0.1, "steps": {}, "benchmark": {"levels": []}, "versions": {},
         "rollout": {"strategy": "reload", "previous": {"digest": "abc"}, "version": 3},
         "rollback": {"status": "rolled back", "action": "reloaded version 2", "duration_s": 4.2},
         "triton_metrics": [{"model": "ensemble", "requests": 3, "failed": 0}]}
    text = markdown(m, [])
    assert "## Rollback" in text and "**rolled back**: reloaded version 2 (4.2 s)" in text
    assert "strategy `reload`, live version 3" in text and "| ensemble | 3 | 0 |" in text


def _prefect_table():
    """Prefect's idempotency: the first run created under a key is returned for every later start with it."""
    started, table = [], {}

    async def start(deployment, params, key, identity):
        if key in table:
            first = table[key]
            return Started(first.run_id, first.run_name, False, first.identity)
        started.append((deployment, params, key))
        table[key] = Started(f"run-{len(started)}", "name", True, identity)
        return table[key]

    return start, started


async def _ok(_spec, _deployment):
    return None


def _receiver(tmp_path, start, check=_ok, clock=lambda: 1000.0, **cfg):
    (tmp_path / "tiny.yaml").write_text("model: {repo_id: o/m}\nstorage: {bucket: b-b-b}\n")
    cfg = ReceiverConfig(secret=b"k", specs_dir=tmp_path, **{"max_body_bytes": 300, "window_s": 60,
                                                             "rate_per_s": 0.01, "burst": 6, **cfg})
    return TestClient(create_app(cfg, start_run=start, check_run=check, clock=clock))


@pytest.fixture
def app(tmp_path):
    start, started = _prefect_table()
    return _receiver(tmp_path, start), started


def _signed(payload, now=1000.0, secret=b"k"):
    body, headers = signing.signed_body(payload, secret, now=now)
    return {"content": body, "headers": headers}


def test_receiver_answers(app):
    client, started = app
    ok = client.post("/hooks/build", **_signed({"spec": "tiny", "revision": "v2", "repo": "o/m"}))
    assert ok.status_code == 202 and ok.json()["flow_run_id"] == "run-1"
    assert started[0][1]["spec"]["model"]["revision"] == "v2" and started[0][2].startswith("webhook:")
    again = client.post("/hooks/build", **_signed({"spec": "tiny", "revision": "v2", "repo": "o/m"}))
    assert again.status_code == 202 and again.json() == {"flow_run_id": "run-1", "duplicate": True}
    assert client.post("/hooks/build", **_signed({"spec": "tiny", "revision": "v2"}, secret=b"x")).status_code == 401
    assert client.post("/hooks/build", **_signed({"spec": "tiny", "revision": "v2"}, now=900)).status_code == 401
    assert client.post("/hooks/build", **_signed({"spec": "tiny", "revision": "v", "repo": "x/y"})).status_code == 400
    assert client.post("/hooks/build", **_signed({"spec": "tiny", "revision": "v", "pad": "x" * 400})
                       ).status_code == 413
    # burst 6: five signed requests above took a token each (413 is refused before the bucket), one is left
    assert [client.post("/hooks/build", content=b"{}").status_code for _ in range(2)] == [401, 429]
    assert len(started) == 1


def test_the_stack_lacking_what_the_run_needs_is_refused_before_the_run(tmp_path):
    start, started = _prefect_table()

    async def no_block(_spec, _deployment):
        raise Refused(400, "storage.credentials_block 's3-prod' (bucket 'b-b-b'): no Prefect AwsCredentials block")

    async def no_worker(_spec, deployment):
        raise Refused(503, f"webhook: work pool 'p' of {deployment!r} has no online worker; start one (…)")

    trigger = {"spec": "tiny", "revision": "v2", "idempotency_key": "k1"}
    r = _receiver(tmp_path, start, check=no_block).post("/hooks/build", **_signed(trigger))
    assert r.status_code == 400 and r.json()["error"].startswith("spec 'tiny': storage.credentials_block 's3-prod'")
    r = _receiver(tmp_path, start, check=no_worker).post("/hooks/build", **_signed(trigger))
    assert r.status_code == 503 and "has no online worker" in r.json()["error"]
    assert started == []
    # Refused is not remembered: the same key goes through once the stack has what it needs.
    assert _receiver(tmp_path, start).post("/hooks/build", **_signed(trigger)).status_code == 202
