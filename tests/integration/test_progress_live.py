"""Progress against real servers (issue 14 item 7): an upload's bytes into the real moto S3, and a progress
artifact through Prefect's temporary API, updated from another thread as an upload's threads do."""

from __future__ import annotations

import hashlib
import io
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from stoker.record import progress
from stoker.storage import s3
from stoker.storage.digest import FileRecord
from stoker.record.progress import Progress
from stoker.spec.schema import Storage
from stoker.stack.s3server import TEST_CREDENTIALS

DIGEST = "e" * 64
_LINE = re.compile(r"^upload: (\d+\.\d)/(\d+\.\d) MB \((\d+)%")


@pytest.mark.s3
def test_an_upload_reports_its_bytes_every_ten_percent_not_every_file(tmp_path, monkeypatch, s3_server):
    url = s3_server
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    storage = Storage(bucket=f"progress-{uuid.uuid4().hex[:8]}", prefix="stoker", endpoint_url=url, create_bucket=True)
    client = s3.client(storage)
    s3.ensure_bucket(client, storage, create=True)
    records = []
    for i in range(21):  # one multipart file (17 MB, sent in parts by several threads) and 20 small ones
        data = os.urandom(17 << 20 if i == 0 else 128 << 10)
        rel = f"m{i:02d}/1/w.bin"
        (tmp_path / "repo" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / rel).write_bytes(data)
        records.append(FileRecord(rel, hashlib.sha256(data).hexdigest(), len(data)))

    lines: list[str] = []
    s3.upload_tree(client, storage, tmp_path / "repo", records, [], DIGEST, lines.append)
    steps = [line for line in lines if _LINE.match(line)]
    percents = [int(_LINE.match(line).group(3)) for line in steps]
    # Bytes, as they go out: lines at 10 % steps (or every 5 s), not one per file; the last says 100 %.
    assert 2 <= len(steps) <= 11 and percents == sorted(percents) and percents[-1] == 100, lines
    assert steps[-1].startswith("upload: 20.4/20.4 MB (100%, ")
    assert any(0 < p < 100 for p in percents), lines
    assert lines[len(steps)] == "upload: 21 files, 20.4 MB: 21 sent, 0 identical (skipped, 0.0 MB)"
    assert not any("w.bin" in line for line in lines)

    again: list[str] = []  # everything is there already: skipped files count as done at once
    s3.upload_tree(client, storage, tmp_path / "repo", records, [], DIGEST, again.append)
    assert again[-2].startswith("upload: 20.4/20.4 MB (100%, ")
    assert again[-1] == "upload: 21 files, 20.4 MB: 0 sent, 21 identical (skipped, 20.4 MB)"


@pytest.mark.prefect
def test_a_task_run_gets_a_progress_artifact_updated_from_other_threads(monkeypatch):
    from stoker.stack.prefect_ephemeral import TELEMETRY_SETTING, prepare_temporary_api

    # Said here, and undone at teardown: prepare_temporary_api would set it for the rest of this worker's tests, and
    # the `stoker` processes they start would inherit it, hiding whether stoker turns telemetry off by itself.
    monkeypatch.setenv(TELEMETRY_SETTING, "false")
    prepare_temporary_api()
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId
    from prefect.context import TaskRunContext

    monkeypatch.setattr(progress, "ARTIFACT_EVERY_S", 0.0)  # every 10 % step, not at most once a second

    def artifacts(task_run_id):
        with get_client(sync_client=True) as client:
            return client.read_artifacts(
                artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])))

    @task
    def upload_like() -> tuple[str, list]:
        task_run_id = TaskRunContext.get().task_run.id
        with Progress("upload", 100, "B", lambda _l: None, stream=io.StringIO()) as p:
            with ThreadPoolExecutor(max_workers=4) as pool:  # no run context in these threads
                list(pool.map(lambda _i: p.advance(10), range(5)))
            midway = [(a.type, a.data, a.description) for a in artifacts(task_run_id)]
        return task_run_id, midway

    @flow
    def one_step():
        return upload_like()

    task_run_id, midway = one_step()
    assert midway == [("progress", 50.0, "upload: 50.0/100.0 B (50%)")]
    [done] = artifacts(task_run_id)
    assert done.type == "progress" and done.data == 100.0 and done.description.startswith("upload: 100.0/100.0 B (100%")
