"""`stoker sync-repo` (the Kubernetes init container's command) against the session's real S3: a complete upload
lands verified; a digest S3 does not hold, or a tampered object, leaves nothing behind and exits 1 in one line."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.s3


@pytest.fixture
def uploaded(s3_server, tmp_path, monkeypatch):
    from stoker.spec.schema import Storage
    from stoker.stack.s3server import TEST_CREDENTIALS
    from stoker.storage import s3
    from stoker.storage.digest import records_digest, tree_records

    for key, value in TEST_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    storage = Storage(bucket="stoker-sync-repo", endpoint_url=s3_server, create_bucket=True)
    repo = tmp_path / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text('name: "echo"\nbackend: "python"\n')
    (repo / "echo" / "1" / "model.py").write_text("# echo\n")
    records = tree_records(repo)
    digest = records_digest(records)
    client = s3.client(storage)
    s3.ensure_bucket(client, storage, create=True)
    s3.upload_tree(client, storage, repo, records, [], digest, lambda _line: None)
    return storage, digest, client


def _sync(storage, digest, dest) -> int:
    from stoker.cli import main

    return main(["sync-repo", str(dest), "--bucket", storage.bucket, "--endpoint-url", storage.endpoint_url,
                 "--digest", digest])


def test_sync_repo_lands_the_verified_build(uploaded, tmp_path, capsys):
    storage, digest, _ = uploaded
    dest = tmp_path / "models" / "model_repository"
    dest.parent.mkdir()
    assert _sync(storage, digest, dest) == 0
    assert (dest / "echo" / "1" / "model.py").read_text() == "# echo\n"
    assert _sync(storage, digest, dest) == 0  # a restarted pod keeps the copy it has
    assert "already holds digest" in capsys.readouterr().out


def test_sync_repo_refuses_a_tampered_object(uploaded, tmp_path, capsys):
    from stoker.storage import s3

    storage, digest, client = uploaded
    key = f"{s3.repo_prefix(storage, digest)}/model_repository/echo/1/model.py"
    client.put_object(Bucket=storage.bucket, Key=key, Body=b"# evil\n")  # same size: the marker still counts
    dest = tmp_path / "model_repository"
    assert _sync(storage, digest, dest) == 1
    assert "digest mismatch" in capsys.readouterr().err
    assert not dest.exists() and not list(tmp_path.glob(".tmp-*"))
    assert _sync(storage, "0" * 64, dest) == 1  # no upload of that digest
