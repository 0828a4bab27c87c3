"""The stack's and demo's S3 keeps its data across a restart (issue 49 item 8): objects written, the service stopped
and started again through stoker/stack/s3server.py, everything read back as it was, deletions included, and the
conditional writes the build cache's lease relies on still refuse a second creator after the restart."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from stoker.stack import s3server, services

pytestmark = pytest.mark.s3


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir()
    yield state
    services.stop_all(state)


def _client(url: str):
    env = s3server.TEST_CREDENTIALS
    return boto3.client("s3", endpoint_url=url, region_name=env["AWS_DEFAULT_REGION"],
                        aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                        config=Config(retries={"total_max_attempts": 1}))


def _code(err: ClientError) -> str:
    return str(err.response["Error"]["Code"])


def test_objects_survive_a_restart_and_a_kill_and_deletions_stay_deleted(state_dir: Path, tmp_path: Path):
    data = tmp_path / "s3-data"
    url = s3server.ensure_s3(state_dir, data_dir=data)
    s3 = _client(url)
    s3.create_bucket(Bucket="stoker")
    s3.put_object(Bucket="stoker", Key="p/runs/r1/manifest.json", Body=b'{"run_id": "r1"}',
                  Metadata={"sha256": "abc"}, ContentType="application/json")
    s3.put_object(Bucket="stoker", Key="p/repos/d1/stoker-repo.json", Body=b"marker")
    s3.put_object(Bucket="stoker", Key="p/repos/d1/model_repository/m/1/", Body=b"")
    s3.put_object(Bucket="stoker", Key="p/gone", Body=b"deleted before the restart")
    s3.delete_object(Bucket="stoker", Key="p/gone")
    big = os.urandom(6 << 20)  # a multipart upload of two parts: its ETag ("…-2") must come back as it was
    mp = s3.create_multipart_upload(Bucket="stoker", Key="p/repos/d1/model_repository/m/1/model.bin")
    parts = [{"PartNumber": i + 1, "ETag": s3.upload_part(Bucket="stoker", Key=mp["Key"], UploadId=mp["UploadId"],
                                                         PartNumber=i + 1, Body=chunk)["ETag"]}
             for i, chunk in enumerate((big[:5 << 20], big[5 << 20:]))]
    s3.complete_multipart_upload(Bucket="stoker", Key=mp["Key"], UploadId=mp["UploadId"],
                                 MultipartUpload={"Parts": parts})
    s3.copy_object(Bucket="stoker", Key="p/live/dep/model.bin", CopySource={"Bucket": "stoker", "Key": mp["Key"]})
    before = {o["Key"]: (o["ETag"], o["Size"]) for o in s3.list_objects_v2(Bucket="stoker")["Contents"]}

    # A restart through the project's own service functions, then a kill (a crash or a reboot: no clean shutdown).
    for stop in ("stop", "kill"):
        handle = services.is_running(s3server.SERVICE_NAME, state_dir)
        if stop == "stop":
            assert services.stop_service(s3server.SERVICE_NAME, state_dir) is True
        else:
            os.killpg(handle.pid, signal.SIGKILL)
            os.waitpid(handle.pid, 0)  # started by this process: reap it, or it lingers as a zombie that looks alive
        # As after a reboot, the old server is gone before the new one starts: its socket may outlive the signal
        # by a moment (a CI run met PortInUse here), so wait for the port rather than race it.
        deadline = time.monotonic() + 15
        while not services.port_free(handle.port) and time.monotonic() < deadline:
            time.sleep(0.1)
        url = s3server.ensure_s3(state_dir, port=handle.port, data_dir=data)
        s3 = _client(url)
        after = {o["Key"]: (o["ETag"], o["Size"]) for o in s3.list_objects_v2(Bucket="stoker")["Contents"]}
        assert after == before and "p/gone" not in after
        got = s3.get_object(Bucket="stoker", Key="p/runs/r1/manifest.json")
        assert got["Body"].read() == b'{"run_id": "r1"}' and got["Metadata"] == {"sha256": "abc"}
        assert got["ContentType"] == "application/json"
        assert s3.get_object(Bucket="stoker", Key="p/live/dep/model.bin")["Body"].read() == big
        # The lease's create (If-None-Match: *) still loses to what is there.
        with pytest.raises(ClientError) as refused:
            s3.put_object(Bucket="stoker", Key="p/runs/r1/manifest.json", Body=b"other", IfNoneMatch="*")
        assert _code(refused.value) in ("412", "PreconditionFailed")

    # Deleting the copy keeps the original's bytes (one blob on disk serves both); deleting both frees it.
    s3.delete_object(Bucket="stoker", Key="p/live/dep/model.bin")
    assert s3.get_object(Bucket="stoker", Key=mp["Key"])["Body"].read() == big
    s3.delete_object(Bucket="stoker", Key=mp["Key"])
    assert not [b for b in (data / "blobs").iterdir() if b.stat().st_size == len(big)]


def test_the_persistent_server_keeps_the_conditional_writes_the_lease_needs(state_dir: Path, tmp_path: Path):
    """The disk layer changes no answer: tests/integration/s3_conditional_probe.py passes every check on it (it is
    the probe that found s3rver ignoring them)."""
    import s3_conditional_probe

    url = s3server.ensure_s3(state_dir, data_dir=tmp_path / "s3-data")
    s3 = _client(url)
    s3.create_bucket(Bucket="probe")
    results = s3_conditional_probe.probe(s3, url, "probe")
    assert len(results) == 5 and all(results.values()), results


def test_without_a_data_folder_the_server_stays_in_memory(state_dir: Path):
    url = s3server.ensure_s3(state_dir)
    s3 = _client(url)
    s3.create_bucket(Bucket="scratch")
    s3.put_object(Bucket="scratch", Key="k", Body=b"v")
    port = services.is_running(s3server.SERVICE_NAME, state_dir).port
    services.stop_service(s3server.SERVICE_NAME, state_dir)
    s3 = _client(s3server.ensure_s3(state_dir, port=port))
    with pytest.raises(ClientError) as gone:
        s3.head_bucket(Bucket="scratch")
    assert _code(gone.value) in ("404", "NoSuchBucket")
