"""The S3 layer of the step cache: `<prefix>/cache/<step>/<key>/` in the spec's bucket, keyed like the local one.

  <step>/<key>/blobs/<sha256>   each distinct output file, named by its content
  <step>/<key>/record.json      the marker, written last and only if none exists: step, key, digest, detail,
                                files (path, sha256, bytes), empty_dirs
  <step>/<key>/.lease           the builder's lease while one works (lease.py)

Blobs are named by content so that two builders of one key (a holder whose lease was taken over, and the one
that took it) can never mix their files: whichever marker lands first names blobs that are all there. A reader
trusts an entry only when its marker parses and every blob it names is there with its size; a download is
checked against the marker's sha256s as well.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from ..storage.digest import FileRecord, file_sha256, records_digest, records_from_json, records_to_json, unsafe_record
from ..record.progress import Progress
from ..storage.s3 import S3Error, failure
from ..spec.schema import Storage
from ..storage.store import Entry
from .sweep import remote_litter, stale_upload

RECORD = "record.json"
BLOBS = "blobs"
_TRANSFER = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20, max_concurrency=4)
_FILES_AT_ONCE = 4
_MISSING = ("404", "NoSuchKey", "NotFound")


class CorruptEntry(S3Error):
    """A downloaded file does not match the marker's sha256, or the marker names a path outside its entry: the
    entry is not used."""


@dataclass(frozen=True)
class RemoteEntry:
    step: str
    key: str
    digest: str
    files: list[FileRecord]
    empty_dirs: list[str] = field(default_factory=list)
    detail: dict = field(default_factory=dict)
    created_at: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass(frozen=True)
class Listed:
    """One `<step>/<key>/` folder as a listing shows it (`stoker cache ls`, prune, sweep)."""

    step: str
    key: str
    has_marker: bool
    has_lease: bool
    bytes: int  # blobs only
    newest: float  # newest object's LastModified (the marker's when there is one)
    objects: tuple[str, ...]  # every key under the folder
    lease_modified: float | None = None  # the lease's LastModified: its last renewal


def cache_root(storage: Storage) -> str:
    return f"{storage.prefix}/cache/"


def entry_prefix(storage: Storage, step: str, key: str) -> str:
    return f"{storage.prefix}/cache/{step}/{key}"


def where(storage: Storage, step: str, key: str) -> str:
    return f"s3://{storage.bucket}/{entry_prefix(storage, step, key)}/"


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", "")
               or err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _sizes(s3, bucket: str, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def lookup(s3, storage: Storage, step: str, key: str) -> RemoteEntry | None:
    """The complete entry for step/key, or None (no marker, an unreadable one, or a blob missing or short)."""
    base = entry_prefix(storage, step, key)
    try:
        r = s3.get_object(Bucket=storage.bucket, Key=f"{base}/{RECORD}")
        rec = json.loads(r["Body"].read())
        files = records_from_json(rec["files"])
        entry = RemoteEntry(step, key, rec["digest"], files, list(rec.get("empty_dirs", [])), rec.get("detail", {}),
                            r["LastModified"].timestamp())
        present = _sizes(s3, storage.bucket, f"{base}/{BLOBS}/")
    except ClientError as err:
        if _code(err) in _MISSING:
            return None
        raise failure(err, f"cache lookup {where(storage, step, key)}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"cache lookup {where(storage, step, key)}", storage) from None
    except (ValueError, KeyError, TypeError):
        return None  # a marker we cannot read is no marker
    if rec.get("step") != step or rec.get("key") != key or records_digest(files) != entry.digest:
        return None
    if any(present.get(f"{base}/{BLOBS}/{f.sha256}") != f.bytes for f in files):
        return None
    return entry


def empty_dirs(root: Path) -> list[str]:
    """Folders under root with nothing in them: file records cannot carry them, and Triton needs `ensemble/1/`."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir() and not any(p.iterdir()))


def upload(s3, storage: Storage, entry: Entry, log: Callable[[str], None]) -> bool:
    """Blobs first (those already there with their size are skipped), then the marker if none exists.

    Returns False when a marker was already there (another builder published the key first: theirs stands).
    Raises S3Unreachable / S3Error (stoker.storage.s3) on failure; blobs without a marker are litter the sweep removes.
    """
    base = entry_prefix(storage, entry.step, entry.key)
    unique = {f.sha256: f for f in entry.files}
    try:
        present = _sizes(s3, storage.bucket, f"{base}/{BLOBS}/")
        todo = [f for sha, f in unique.items() if present.get(f"{base}/{BLOBS}/{sha}") != f.bytes]
        total = sum(f.bytes for f in todo)
        with Progress(f"cache upload {entry.step}", total, "B", log) as bar, \
                ThreadPoolExecutor(max_workers=_FILES_AT_ONCE) as pool:
            list(pool.map(lambda f: s3.upload_file(str(entry.output_dir / f.path), storage.bucket,
                                                   f"{base}/{BLOBS}/{f.sha256}", Config=_TRANSFER,
                                                   Callback=bar.advance), todo))
        present = _sizes(s3, storage.bucket, f"{base}/{BLOBS}/")
        short = [f.path for f in unique.values() if present.get(f"{base}/{BLOBS}/{f.sha256}") != f.bytes]
        if short:
            raise S3Error(f"cache upload {where(storage, entry.step, entry.key)}: {len(short)} blobs missing after "
                          f"upload, e.g. {short[0]}")
        record = {"step": entry.step, "key": entry.key, "digest": entry.digest, "files": records_to_json(entry.files),
                  "empty_dirs": empty_dirs(entry.output_dir), "detail": entry.detail, "uploaded_at": time.time()}
        s3.put_object(Bucket=storage.bucket, Key=f"{base}/{RECORD}", IfNoneMatch="*", ContentType="application/json",
                      Body=json.dumps(record, indent=1, sort_keys=True).encode())
    except ClientError as err:
        if _code(err) in ("412", "PreconditionFailed", "409", "ConditionalRequestConflict"):
            return False
        raise failure(err, f"cache upload {where(storage, entry.step, entry.key)}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"cache upload {where(storage, entry.step, entry.key)}", storage) from None
    log(f"cache: {entry.step}/{entry.key} uploaded to {where(storage, entry.step, entry.key)} "
        f"({len(todo)} of {len(unique)} files sent, {total / 1e6:.1f} MB)")
    return True


def download(s3, storage: Storage, entry: RemoteEntry, out: Path, log: Callable[[str], None]) -> dict:
    """Fetch the entry's files into `out` (a local temp folder), each checked against its sha256; its detail.

    Raises CorruptEntry on a mismatch, S3Unreachable / S3Error when S3 fails."""
    base = entry_prefix(storage, entry.step, entry.key)
    # The record comes from S3, writable by every worker: check every path before the first byte is written.
    bad = unsafe_record(entry.files, entry.empty_dirs)
    if bad is not None:
        raise CorruptEntry(f"cache entry {where(storage, entry.step, entry.key)}: record.json refused: {bad}")
    root = out.resolve()

    def one(f: FileRecord) -> None:
        dest = out / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        if not dest.parent.resolve().is_relative_to(root):  # belt and braces: no link may lead out
            raise CorruptEntry(f"cache entry {where(storage, entry.step, entry.key)}: {f.path} leads outside it")
        s3.download_file(storage.bucket, f"{base}/{BLOBS}/{f.sha256}", str(dest), Config=_TRANSFER,
                         Callback=bar.advance)
        if file_sha256(dest) != f.sha256:
            raise CorruptEntry(f"cache entry {where(storage, entry.step, entry.key)}: {f.path} does not match "
                               "its sha256 in record.json")

    try:
        with Progress(f"cache download {entry.step}", entry.bytes, "B", log) as bar, \
                ThreadPoolExecutor(max_workers=_FILES_AT_ONCE) as pool:
            list(pool.map(one, entry.files))
    except (ClientError, BotoCoreError) as err:
        raise failure(err, f"cache download {where(storage, entry.step, entry.key)}", storage) from None
    for d in entry.empty_dirs:
        (out / d).mkdir(parents=True, exist_ok=True)
    return entry.detail


def listing(s3, storage: Storage) -> list[Listed]:
    """Every `<step>/<key>/` folder under the cache prefix, complete or not."""
    root = cache_root(storage)
    groups: dict[tuple[str, str], list[dict]] = {}
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=storage.bucket, Prefix=root):
            for o in page.get("Contents", []):
                parts = o["Key"][len(root):].split("/")
                if len(parts) >= 3:
                    groups.setdefault((parts[0], parts[1]), []).append(o)
    except (ClientError, BotoCoreError) as err:
        raise failure(err, f"listing s3://{storage.bucket}/{root}", storage) from None
    out = []
    for (step, key), objs in sorted(groups.items()):
        base = f"{root}{step}/{key}/"
        marker = next((o for o in objs if o["Key"] == base + RECORD), None)
        lease = next((o for o in objs if o["Key"] == base + ".lease"), None)
        newest = (marker or max(objs, key=lambda o: o["LastModified"]))["LastModified"].timestamp()
        out.append(Listed(step, key, marker is not None, lease is not None,
                          sum(o["Size"] for o in objs if o["Key"].startswith(base + BLOBS + "/")), newest,
                          tuple(o["Key"] for o in objs), lease["LastModified"].timestamp() if lease else None))
    return out


def delete(s3, storage: Storage, listed: Listed) -> None:
    """Remove an entry: the marker first, so no reader trusts a half-deleted entry, then the rest."""
    base = entry_prefix(storage, listed.step, listed.key)
    marker = f"{base}/{RECORD}"
    rest = [k for k in listed.objects if k != marker and not k.endswith("/.lease")]
    try:
        if listed.has_marker:
            s3.delete_object(Bucket=storage.bucket, Key=marker)
        for i in range(0, len(rest), 1000):
            s3.delete_objects(Bucket=storage.bucket,
                              Delete={"Objects": [{"Key": k} for k in rest[i:i + 1000]], "Quiet": True})
    except (ClientError, BotoCoreError) as err:
        raise failure(err, f"deleting {where(storage, listed.step, listed.key)}", storage) from None


def sweep_remote(s3, storage, ttl_s: float, log: Callable[[str], None], dry_run: bool = False,
                 now: float | None = None) -> tuple[int, int]:
    """Remove marker-less key folders and multipart uploads older than the lease ttl: (folders, uploads)."""
    now = time.time() if now is None else now
    listed = listing(s3, storage)
    folders = [f for f in listed if remote_litter(f.has_marker, f.newest, now, ttl_s)]
    leased = {entry_prefix(storage, f.step, f.key) + "/": f.lease_modified for f in listed}
    root = cache_root(storage)
    uploads = []
    try:
        for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=storage.bucket, Prefix=root):
            for u in page.get("Uploads", []):
                folder = root + "/".join(u["Key"][len(root):].split("/")[:2]) + "/"
                if stale_upload(u["Initiated"].timestamp(), leased.get(folder), now, ttl_s):
                    uploads.append(u)
        for f in folders:
            log(f"cache sweep: {'would remove' if dry_run else 'removing'} unfinished "
                f"{where(storage, f.step, f.key)} ({len(f.objects)} objects, no marker)")
            if not dry_run:
                for i in range(0, len(f.objects), 1000):
                    s3.delete_objects(Bucket=storage.bucket, Delete={
                        "Objects": [{"Key": k} for k in f.objects[i:i + 1000]], "Quiet": True})
        for u in uploads:
            log(f"cache sweep: {'would abort' if dry_run else 'aborting'} multipart upload of {u['Key']}")
            if not dry_run:
                s3.abort_multipart_upload(Bucket=storage.bucket, Key=u["Key"], UploadId=u["UploadId"])
    except (BotoCoreError, ClientError) as err:
        raise failure(err, f"cache sweep of s3://{storage.bucket}/{cache_root(storage)}", storage) from None
    return len(folders), len(uploads)
