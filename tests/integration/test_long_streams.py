"""Long-lived gRPC streams across a replace (issue 25, item 8), on the real Docker engine, HAProxy, Triton and S3.

A client that keeps one bidi stream open and sends request after request holds a session on the old backend
for as long as it likes; the proxy cannot move it. Retire must neither wait for it until drain_timeout_s nor cut
an answer: it reads the backend's in-flight gauge and ends the stream between requests; the client reconnects
to the new build.
"""

from __future__ import annotations

import threading
import time

import pytest

from stoker.serving import promote
from stoker.triton.metrics import in_flight

from promotion_kit import Lines, assert_one_live, deploy
from promotion_kit import build, client, images, s3, target  # noqa: F401 -- fixtures the tests request
from stream_clients import long_stream_client

pytestmark = [pytest.mark.docker, pytest.mark.s3]
DRAIN_TIMEOUT_S = 60.0


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_idle_long_lived_stream_is_ended_between_requests_not_waited_for(client, target, build):
    deploy(client, target, build("A", interval_s=0.05))
    backend_a = promote.reconcile(client, target, Lines())
    stop, records, stats = threading.Event(), [], {}
    streamer = threading.Thread(target=long_stream_client, args=(target.endpoint["grpc"], stop, records, 0.5, stats),
                                daemon=True)
    streamer.start()
    try:
        _wait(lambda: sum(r[3] for r in records) >= 2, 30, "two answers on the long-lived stream")
        # The backend reports what it has in flight; the proxy sees one stream open to it all along.
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{backend_a.ports.metrics}/metrics", timeout=5) as r:
            assert in_flight(r.read().decode()) is not None
        rt = promote.runtime_for(target, promote.proxy_container(client, target.name))
        assert rt.sessions(backend_a.slot) >= 1

        log = Lines()
        staged = promote.prepare(client, target, build("B", interval_s=0.05), 1.0, log)
        done = promote.go_live(client, target, staged, 2.0, 1.0, DRAIN_TIMEOUT_S, log)
        _wait(lambda: any(r[3] and r[6] == "B" for r in records), 30, "an answer from B on a new stream")
    finally:
        stop.set()
        streamer.join(timeout=60)

    # Unloaded first, never ended on the in-flight reading alone: the stream ends once nothing is loaded, or
    # earlier, when its client met the refusal and reconnected to the live backend itself.
    assert any("no request in flight; it now refuses new requests" in line for line in log), log
    assert not any("ending them between requests" in line for line in log), log
    # Far below DRAIN_TIMEOUT_S: the idle stream did not hold the old backend (a bound against hangs, >= 10x
    # the ~1 s it takes).
    assert done["retire_s"] < DRAIN_TIMEOUT_S / 4, done
    assert stats["reconnects"] >= 1
    truncated = [r for r in records if r[4]]
    assert truncated == [], truncated  # never mid-answer
    # A request sent while the old backend refused new ones (or in the instant its stream ended) fails before any
    # response: the only failure a client can see, at most one per stream; the README tells it to resend.
    failed = [r for r in records if not r[3] and not r[4]]
    assert len(failed) <= 1, failed
    assert {r[6] for r in records if r[3]} == {"A", "B"}
    assert_one_live(client, target, "B")


BUSY_STREAMS = 2


@pytest.mark.parametrize("build", ["reference", "tensorrt"], indirect=True)
def test_busy_streams_lose_no_answer_part_way_through_a_replace(client, target, build):
    """Streams that carry request after request with no pause (tritonclient's streaming examples) are never idle:
    the old backend refuses new requests before any answer, finishes those in flight, then the streams end."""
    deploy(client, target, build("A", interval_s=0.05))
    stop = threading.Event()
    streams = [([], {}) for _ in range(BUSY_STREAMS)]
    threads = [threading.Thread(target=long_stream_client, args=(target.endpoint["grpc"], stop, recs, 0.0, stats),
                                daemon=True) for recs, stats in streams]
    for t in threads:
        t.start()
    log = Lines()
    try:
        _wait(lambda: all(sum(r[3] for r in recs) >= 2 for recs, _ in streams), 60, "answers on every busy stream")
        staged = promote.prepare(client, target, build("B", interval_s=0.05), 1.0, log)
        began = time.time()
        done = promote.go_live(client, target, staged, 2.0, 1.0, DRAIN_TIMEOUT_S, log)
        _wait(lambda: all(any(r[3] and r[6] == "B" for r in recs) for recs, _ in streams), 60,
              "answers from B on every busy stream")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)

    for i, (recs, stats) in enumerate(streams):
        truncated = [r for r in recs if r[4]]
        assert truncated == [], (i, truncated)  # every answer that started has all its tokens
        failed = [r for r in recs if not r[3]]
        print(f"stream {i}: {len(recs)} requests, {len(failed)} failed before any answer, "
              f"{stats['reconnects']} reconnect(s): {[r[5] for r in failed]}")
        # At most one request per stream per rollout fails, before any answer (truncated is empty): safe to resend.
        assert len([r for r in failed if r[1] >= began]) <= 1, (i, failed)
        assert {r[6] for r in recs if r[3]} == {"A", "B"}, i
        assert stats["reconnects"] >= 1, i
    assert any("refuses new requests" in line for line in log), log
    assert done["retire_s"] < DRAIN_TIMEOUT_S, done  # the busy streams did not hold the old backend to the deadline
    assert_one_live(client, target, "B")


PAUSED_GAPS_S = (0.3, 0.05)


def test_paused_and_busy_streams_lose_no_answer_part_way_through_a_replace(client, target, build):
    """A stream that pauses between requests reads as idle to the in-flight gauge; its next request can start in
    the instant the streams would be ended. Retire unloads the old backend first (new requests refused before any
    answer, those in flight finish) and ends the streams only once nothing is loaded: no answer is cut, and each
    stream, paused or busy, loses at most one request, before any answer. Two replaces, so the idle reading (paused
    streams alone between busy requests) and the busy one both get their chance."""
    deploy(client, target, build("A", interval_s=0.05))
    stop = threading.Event()
    gaps = (*PAUSED_GAPS_S, 0.0)
    streams = [([], {}) for _ in gaps]
    threads = [threading.Thread(target=long_stream_client, args=(target.endpoint["grpc"], stop, recs, gap, stats),
                                daemon=True) for (recs, stats), gap in zip(streams, gaps)]
    for t in threads:
        t.start()
    log, windows = Lines(), []
    try:
        _wait(lambda: all(sum(r[3] for r in recs) >= 2 for recs, _ in streams), 60, "answers on every stream")
        for tag in ("B", "C"):
            staged = promote.prepare(client, target, build(tag, interval_s=0.05), 1.0, log)
            began = time.time()
            done = promote.go_live(client, target, staged, 2.0, 1.0, DRAIN_TIMEOUT_S, log)
            windows.append((began, time.time()))
            assert done["retire_s"] < DRAIN_TIMEOUT_S, done
            _wait(lambda: all(any(r[3] and r[6] == tag for r in recs) for recs, _ in streams), 60,
                  f"answers from {tag} on every stream")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)

    for i, ((recs, stats), gap) in enumerate(zip(streams, gaps)):
        truncated = [r for r in recs if r[4]]
        assert truncated == [], (gap, truncated)  # no answer stopped part-way, paused stream or busy
        failed = [r for r in recs if not r[3]]
        print(f"stream gap {gap}: {len(recs)} requests, {len(failed)} failed before any answer, "
              f"{stats['reconnects']} reconnect(s): {[r[5] for r in failed]}")
        for began, ended in windows:  # at most one request per stream per rollout, refused before any answer
            assert len([r for r in failed if began <= r[1] <= ended]) <= 1, (gap, failed)
        assert len(failed) <= len(windows), (gap, failed)
        assert {r[6] for r in recs if r[3]} == {"A", "B", "C"}, gap
    assert not any("cannot refuse new requests" in line for line in log), log
    assert_one_live(client, target, "C")
