"""A build's repository as a folder on this host, for a backend that mounts it (the GPU targets' engine backends
read absolute paths inside it): the package step's folder while it still holds the recorded bytes, else a copy of
the repository the run uploaded (`<prefix>/repos/<digest>/model_repository`, stoker/storage/s3.py), fetched into
``$STOKER_HOME/repos/<digest[:24]>``.

The package folder is a step-cache entry that `stoker cache prune` may remove; the upload is never deleted. The copy
lands under a temp name, is checked against the upload's marker (every file's sha256) and the run's recorded digest,
and only then renamed into place: a backend never mounts a half or wrong copy. It lives outside the step cache, so
pruning the cache cannot take it from under the backend that mounts it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from botocore.exceptions import BotoCoreError, ClientError

from ..errors import StokerError
from ..record.progress import Progress
from ..spec.schema import Storage
from ..storage import s3
from ..storage.digest import FileRecord, file_sha256, records_digest, tree_records, unsafe_record

FOLDER = "repos"  # under $STOKER_HOME

Log = Callable[[str], None]


class RepositoryUnavailable(StokerError):
    """No complete upload of the digest in S3, or what S3 holds is not the recorded build (a digest mismatch)."""


def matches(folder: Path, digest: str) -> bool:
    """Whether ``folder`` holds exactly the files the digest was computed over (stoker.storage.store's records)."""
    return folder.is_dir() and records_digest(tree_records(folder)) == digest


def local_copy(storage: Storage, digest: str, package_folder: Path | None, home: Path, log: Log) -> tuple[Path, str]:
    """The folder to mount for the build ``digest``, and one line saying where it came from.

    Raises RepositoryUnavailable, S3Unreachable or S3Error (one line each); nothing is left behind on failure.
    """
    if package_folder is not None and matches(package_folder, digest):
        return package_folder, f"the package step's folder {package_folder}"
    why = ("is not recorded" if package_folder is None else
           "is gone" if not package_folder.exists() else "no longer holds the recorded files")
    dest = home / FOLDER / digest[:24]
    if matches(dest, digest):
        return dest, f"{dest}, fetched from S3 before (the package step's folder {why})"
    source = fetch(storage, digest, dest, log)
    return dest, f"downloaded from {source} into {dest} (the package step's folder {why})"


def fetch(storage: Storage, digest: str, dest: Path, log: Log) -> str:
    """Download the upload of ``digest`` into ``dest`` (replacing a stale folder there); returns its s3:// address."""
    client = s3.client(storage)
    base = f"{s3.repo_prefix(storage, digest)}/model_repository"
    source = f"s3://{storage.bucket}/{base}"
    marker = s3.read_marker(client, storage, digest)  # None unless every object it lists is there with its size
    if marker is None:
        raise RepositoryUnavailable(f"no complete upload of digest {digest[:12]} at {source}")
    files = [FileRecord(str(o.get("key", "")).removeprefix(base + "/"), o.get("sha256"), o.get("bytes"))
             for o in marker.get("objects", [])]
    empty = list(marker.get("empty_dirs", []))
    # The marker comes from S3, writable by every worker: its paths are checked before a byte is written, and it must
    # describe the very build the run recorded.
    bad = unsafe_record(files, empty)
    if bad is not None:
        raise RepositoryUnavailable(f"{source}: the upload's marker is refused: {bad}")
    if records_digest(files) != digest:
        raise RepositoryUnavailable(f"digest mismatch: the upload at {source} lists files whose digest is "
                                    f"{records_digest(files)[:12]}, not the recorded {digest[:12]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:24]}-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep a container running as another user out of its mount
        with Progress("rollback download", sum(f.bytes for f in files), "B", log) as bar:
            for f in files:
                path = tmp / f.path
                path.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(storage.bucket, f"{base}/{f.path}", str(path), Callback=bar.advance)
                if file_sha256(path) != f.sha256:
                    raise RepositoryUnavailable(f"digest mismatch: {source}/{f.path} does not match its sha256 in "
                                                "the upload's marker")
        for d in [*empty, *version_folders([f.path for f in files], empty)]:
            (tmp / d).mkdir(parents=True, exist_ok=True)
        # Each file matched its sha256 and the list matches the digest: the copy is the build if it holds nothing else.
        extra = sorted({p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir()}
                       - {f.path for f in files})
        if extra:
            raise RepositoryUnavailable(f"digest mismatch: {source} gave {extra[0]}, which its marker does not list")
        _put_in_place(tmp, dest, digest)
    except (BotoCoreError, ClientError) as err:
        raise s3.failure(err, f"downloading {source}", storage) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed into place
    return source


def version_folders(files: list[str], empty_dirs: list[str]) -> list[str]:
    """``<model>/1`` for each model of a repository (a top-level folder holding config.pbtxt) that has no version
    folder among its files and recorded empty folders. Pure.

    Triton refuses a model without a version folder, and stoker writes version 1 of every model it renders
    (stoker/triton/repository.py, stoker/gpu/repository.py), the ensemble's empty. Files carry no empty folder, and
    a GPU package step records none for the upload, so its S3 copy lacks ``ensemble/1/``: put back here.
    """
    models = {p.split("/")[0] for p in files if p.count("/") == 1 and p.endswith("/config.pbtxt")}
    versioned = {p.split("/")[0] for p in [*files, *empty_dirs] if p.count("/") >= 1 and p.split("/")[1].isdigit()}
    return sorted(f"{m}/1" for m in models - versioned)


def _put_in_place(tmp: Path, dest: Path, digest: str) -> None:
    """Rename the verified copy to ``dest``. A good copy already there (another rollback's, finished meanwhile) is
    kept, as a backend may be starting on it; a stale one (nothing mounts it: no backend serves this digest, or
    rollback would not fetch it) is renamed aside first and removed, so ``dest`` is never half of either."""
    if dest.exists() and matches(dest, digest):
        return
    if dest.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-stale-", dir=dest.parent))
        os.rename(dest, aside / dest.name)
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, dest)
