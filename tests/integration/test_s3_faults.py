"""S3 blips heal, with a real fault: the moto server process is frozen (SIGSTOP) in the middle of an upload.

A frozen server still accepts TCP connections (the kernel does), reads nothing and answers nothing; when it
resumes (SIGCONT) it applies what it had queued, including requests the client gave up on. Each test has
its own moto server, so freezing it disturbs no other test, and short timeouts (STOKER_S3_*_TIMEOUT_S) so a
freeze of a few seconds is several timed-out attempts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stoker.storage import s3
from stoker.storage.digest import FileRecord
from stoker.errors import is_transient
from stoker.spec.schema import Storage
from stoker.stack.s3server import TEST_CREDENTIALS, ensure_s3
from stoker.stack.services import is_running, stop_all

pytestmark = [pytest.mark.s3]
HELPER = Path(__file__).with_name("s3_upload_flow.py")
DIGEST = "f" * 64
EMPTY_DIRS = ["ensemble/1"]
TIMEOUT_S = "1"  # connect and read: a 3 s freeze is several timed-out attempts
# The upload's first progress line ("upload: 2.6/26.2 MB (10%)"): some objects are in, most are still to go.
UNDER_WAY = re.compile(r"upload: [\d.]+/[\d.]+ MB \(\d+%\)$")


class Frozen:
    """SIGSTOP/SIGCONT for the moto server's process group; always resumed at the end."""

    def __init__(self, pid: int):
        self.pid = pid
        self.stopped_at: float | None = None

    def stop(self) -> None:
        os.killpg(self.pid, signal.SIGSTOP)
        self.stopped_at = time.monotonic()

    def cont(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A moto server of this test's own, its bucket, and the short timeouts."""
    state = tmp_path / "s3-server"
    url = ensure_s3(state)
    frozen = Frozen(is_running("s3", state).pid)
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("STOKER_S3_CONNECT_TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setenv("STOKER_S3_READ_TIMEOUT_S", TIMEOUT_S)
    storage = Storage(bucket="faults", prefix="stoker", endpoint_url=url, create_bucket=True)
    s3.ensure_bucket(s3.client(storage), storage, create=True)
    yield {"storage": storage, "frozen": frozen, "url": url, "state": state}
    frozen.cont()
    stop_all(state)


def _repository(root: Path) -> list[FileRecord]:
    """24 small files (more than the 8 sent at once, so some are still to start when the freeze comes) and one
    of 20 MB (a multipart upload): ~26 MB of random bytes."""
    records = []
    for i in range(25):
        data = os.urandom(20 << 20 if i == 0 else 256 << 10)
        rel = f"model_{i:02d}/1/weights.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        records.append(FileRecord(rel, hashlib.sha256(data).hexdigest(), len(data)))
    return records


def _under_prefix(storage: Storage) -> tuple[list[str], list[str]]:
    """Objects and unfinished multipart uploads under the repository's prefix."""
    c = s3.client(storage)
    prefix = s3.repo_prefix(storage, DIGEST) + "/"
    objects = [o["Key"] for o in c.list_objects_v2(Bucket=storage.bucket, Prefix=prefix).get("Contents", [])]
    uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=storage.bucket, Prefix=prefix).get("Uploads", [])]
    return objects, uploads


def _assert_published(storage: Storage, root: Path, records: list[FileRecord]) -> None:
    """The marker is there, and the repository is exactly the files, byte for byte, plus the placeholders."""
    c = s3.client(storage)
    prefix = s3.repo_prefix(storage, DIGEST)
    assert s3.read_marker(c, storage, DIGEST) is not None
    for rec in records:
        body = c.get_object(Bucket=storage.bucket, Key=f"{prefix}/model_repository/{rec.path}")["Body"].read()
        assert body == (root / rec.path).read_bytes() and hashlib.sha256(body).hexdigest() == rec.sha256
    objects, uploads = _under_prefix(storage)
    want = {f"{prefix}/model_repository/{r.path}" for r in records} | {f"{prefix}/{s3.MARKER}"} | {
        f"{prefix}/model_repository/{d}/" for d in EMPTY_DIRS}
    assert sorted(objects) == sorted(want) and uploads == []


def test_a_freeze_mid_upload_is_retried_and_the_upload_completes(server, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "5")
    storage, frozen = server["storage"], server["frozen"]
    records = _repository(tmp_path / "repo")
    freeze_s = 3.0

    def progress(line: str) -> None:
        if UNDER_WAY.match(line) and frozen.stopped_at is None:  # under way: freeze
            frozen.stop()
            threading.Timer(freeze_s, frozen.cont).start()

    caplog.set_level(logging.DEBUG, logger="botocore.retries.standard")
    t0 = time.monotonic()
    done = s3.upload_tree(s3.client(storage), storage, tmp_path / "repo", records, EMPTY_DIRS, DIGEST, progress)
    assert frozen.stopped_at is not None and time.monotonic() - frozen.stopped_at >= freeze_s
    assert any("Retry needed" in r.message for r in caplog.records), "no request timed out and was retried"
    assert len(done) == len(records)
    _assert_published(storage, tmp_path / "repo", records)
    # A deadline against hangs: 10x the expected ~5 s (the 3 s freeze, then 1 s timeouts and backoff), not a speed
    # claim.
    assert time.monotonic() - t0 < 60


def test_an_upload_that_finally_fails_leaves_nothing_under_its_prefix(server, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    storage, frozen = server["storage"], server["frozen"]
    records = _repository(tmp_path / "repo")
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        if UNDER_WAY.match(line) and frozen.stopped_at is None:
            frozen.stop()  # for good: every retry of the upload times out
        if line.startswith("upload: removing everything under"):
            threading.Timer(1.0, frozen.cont).start()  # back while the failed upload cleans up

    with pytest.raises(s3.S3Unreachable) as failed:
        s3.upload_tree(s3.client(storage), storage, tmp_path / "repo", records, EMPTY_DIRS, DIGEST, progress)
    message = str(failed.value)
    assert "\n" not in message and "stalled or dropped the connection" in message and server["url"] in message
    assert is_transient(failed.value)  # the upload task's retry condition: Prefect retries it
    assert "upload: nothing left under" in lines[-1], lines[-3:]
    # What the frozen server had queued (PUTs the client gave up on) has landed by now, and was removed.
    time.sleep(1.5)
    assert _under_prefix(storage) == ([], [])
    assert s3.read_marker(s3.client(storage), storage, DIGEST) is None


@pytest.mark.prefect
@pytest.mark.slow
def test_the_upload_task_retries_a_freeze_that_outlasts_boto3s_retries(server, tmp_path):
    """Through Prefect: attempt 1 fails (the server stays frozen through every boto3 retry), the server
    comes back during the retry delay, attempt 2 skips what had arrived and completes."""
    storage = server["storage"]
    root = tmp_path / "repo"
    records = _repository(root)
    job = tmp_path / "job.json"
    frozen, lines = server["frozen"], []
    # The retry must find something already there and something still to send: the helper freezes the server the
    # moment the first object's PUT is answered (a watcher polling from here saw the first object only after the
    # whole upload had finished on a loaded host, and the freeze then came too late to fail anything).
    job.write_text(json.dumps({"root": str(root), "digest": DIGEST, "empty_dirs": EMPTY_DIRS,
                               "home": str(tmp_path / "home"), "storage": storage.model_dump(mode="json"),
                               "files": [r.__dict__ for r in records], "freeze_pgid": frozen.pid}))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "STOKER_HOME": str(tmp_path / "home"),
           "PREFECT_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", "AWS_MAX_ATTEMPTS": "2"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, str(HELPER), str(job)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith("FROZEN"):
                frozen.stopped_at = time.monotonic()
            elif "upload: will be retried" in line:
                frozen.cont()
        assert proc.wait(timeout=120) == 0, "\n".join(lines[-30:])
    finally:
        frozen.cont()
        if proc.poll() is None:
            proc.kill()
    log = "\n".join(lines)
    assert frozen.stopped_at is not None
    assert "stalled or dropped the connection" in log and "Retry 1/3" in log, log[-3000:]
    # Attempt 2 reused what attempt 1 (and the queued requests) left.
    assert re.search(r"upload: 25 files, [\d.]+ MB: \d+ sent, [1-9]\d* identical", log), log[-3000:]
    result = json.loads(next(ln for ln in lines if ln.startswith("RESULT ")).removeprefix("RESULT "))
    assert result["detail"]["prefix"] == f"s3://{storage.bucket}/{s3.repo_prefix(storage, DIGEST)}"
    _assert_published(storage, root, records)


def test_discarding_removes_an_unfinished_upload_but_never_a_complete_one(server, tmp_path):
    """What the upload task's last failed attempt calls: a repository without its marker is litter, one with
    a marker over all its objects (written late by a resumed server, or by another publisher) is not."""
    storage = server["storage"]
    records = _repository(tmp_path / "repo")[:4]
    c = s3.client(storage)
    s3.upload_tree(c, storage, tmp_path / "repo", records, EMPTY_DIRS, DIGEST, lambda _l: None)
    lines: list[str] = []
    assert s3.discard_upload(storage, DIGEST, lines.append) == 0 and "holds a complete upload" in lines[-1]
    _assert_published(storage, tmp_path / "repo", records)

    # A marker whose objects are not all there marks nothing.
    c.delete_object(Bucket=storage.bucket, Key=f"{s3.repo_prefix(storage, DIGEST)}/model_repository/{records[1].path}")
    assert s3.read_marker(c, storage, DIGEST) is None
    assert s3.discard_upload(storage, DIGEST, lines.append) == 0 and "nothing left" in lines[-1]
    assert _under_prefix(storage) == ([], [])
