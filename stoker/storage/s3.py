"""S3: the one module that talks to object storage (boto3).

Layout under the spec's prefix:
  <prefix>/repos/<digest>/model_repository/...   the Triton repository
  <prefix>/repos/<digest>/model.sig               its signature (signed builds only), written before the marker
  <prefix>/repos/<digest>/stoker-repo.json        written last: "this upload is complete"
  <prefix>/runs/<run_id>/manifest.json            the run manifest
Triton only ever gets pointed at a repository whose completion marker exists and whose objects are all there.

Blips heal: every call retries a stalled or dropped connection (botocore's standard retry mode, bounded
timeouts), and what still fails raises a `TransientError`, which the step's task retries. Auth, permission
and missing buckets raise `S3Error` at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, HTTPClientError, SSLError
from botocore.exceptions import ConnectionError as BotoConnectionError

from . import credentials
from .digest import FileRecord
from ..errors import StepError, StokerError, TransientError
from ..record.progress import Progress
from ..spec.schema import Storage

MARKER = "stoker-repo.json"
SIGNATURE = "model.sig"  # stoker.storage.signature.SIGNATURE_NAME: OpenSSF model signing's file name
_TRANSFER = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20, max_concurrency=8)
_FILES_AT_ONCE = 8

# Why these numbers. A frozen server still accepts TCP connections (the kernel does that), so only timeouts
# notice it. urllib3 keeps the connect timeout on the socket while it sends a request body, so CONNECT bounds
# a stalled send as well as a connect; READ bounds the wait for an answer (S3 answers a PUT within seconds and
# keeps a slow CompleteMultipartUpload alive with whitespace). Five attempts with the standard mode's jittered
# backoff ride out about a minute of stall inside one call; the task's retries add three more such rounds.
# Knobs: STOKER_S3_CONNECT_TIMEOUT_S, STOKER_S3_READ_TIMEOUT_S, and botocore's own AWS_MAX_ATTEMPTS, AWS_RETRY_MODE.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0
MAX_ATTEMPTS = 5
# A server that comes back from a freeze still applies the requests it had queued, after we gave up on them:
# a prefix must stay empty this long before a cleanup counts it gone.
_QUIET_S = 1.0

# Error codes S3 (and S3-compatible servers) answer for an overloaded or restarting service.
_TRANSIENT_CODES = frozenset({
    "500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
    "RequestTimeoutException", "Throttling", "ThrottlingException", "RequestThrottled", "PriorRequestNotComplete",
    "OperationAborted",
})
_MISSING_CODES = ("404", "NoSuchKey", "NotFound")


class S3Unreachable(TransientError):
    """The endpoint refused, stalled or dropped the connection, or answered "busy": a retry can heal it."""


class S3Error(StepError):
    """Bad credentials, no permission, no bucket, or a request S3 refuses: retrying cannot help."""


class NoSuchBucket(S3Error):
    """The endpoint answered, the keys were accepted, and the bucket does not exist (it may be created)."""


@dataclass(frozen=True)
class UploadedObject:
    key: str
    sha256: str
    bytes: int
    skipped: bool  # an identical object was already there


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise S3Error(f"{name}={raw!r}: not a positive number")
    return value


def timeouts() -> tuple[float, float]:
    """(connect, read) timeouts in seconds for every S3 call."""
    return (_env_number("STOKER_S3_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S),
            _env_number("STOKER_S3_READ_TIMEOUT_S", READ_TIMEOUT_S))


def client(storage: Storage, attempts: int | None = None):
    """A boto3 S3 client that times out on a stalled server and retries it (`attempts` overrides the default)."""
    connect_s, read_s = timeouts()
    total = attempts or int(_env_number("AWS_MAX_ATTEMPTS", MAX_ATTEMPTS))
    cfg = Config(retries={"mode": os.environ.get("AWS_RETRY_MODE") or "standard", "total_max_attempts": total},
                 connect_timeout=connect_s, read_timeout=read_s,
                 max_pool_connections=_FILES_AT_ONCE * _TRANSFER.max_concurrency)
    # Keys from the spec's AwsCredentials block when it names one, else boto3's own chain (environment, profile).
    return boto3.client("s3", endpoint_url=storage.endpoint_url, region_name=storage.region, config=cfg,
                        **credentials.client_kwargs(storage))


def _where(storage: Storage) -> str:
    return storage.endpoint_url or f"AWS S3 ({storage.region})"


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", "")
               or err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def failure(err: BaseException, what: str, storage: Storage) -> StokerError:
    """`err` from boto3 as a one-line error about `what`: S3Unreachable when a retry can heal it, else S3Error."""
    if isinstance(err, StokerError):
        return err
    if isinstance(err, S3UploadFailedError) and isinstance(err.__context__, ClientError):
        err = err.__context__  # boto3 wraps a ClientError of upload_file in this, keeping only its text
    if isinstance(err, EndpointConnectionError):
        return S3Unreachable(f"{what}: S3 endpoint {_where(storage)} is unreachable")
    if isinstance(err, (BotoConnectionError, HTTPClientError)) and not isinstance(err, SSLError):
        return S3Unreachable(f"{what}: S3 endpoint {_where(storage)} stalled or dropped the connection "
                             f"({type(err).__name__})")
    if isinstance(err, ClientError):
        code = _code(err)
        kind = S3Unreachable if code in _TRANSIENT_CODES else S3Error
        return kind(f"{what}: {code or _first_line(err)}")
    return S3Error(f"{what}: {_first_line(err)}")


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def ensure_bucket(s3, storage: Storage, create: bool) -> None:
    """One-line errors for an unreachable endpoint or a missing bucket, before any upload."""
    try:
        s3.head_bucket(Bucket=storage.bucket)
        return
    except EndpointConnectionError:
        raise S3Unreachable(f"S3 endpoint {_where(storage)} is unreachable") from None
    except ClientError as err:
        code = _code(err)
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise failure(err, f"bucket {storage.bucket!r} at {_where(storage)}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"bucket {storage.bucket!r}", storage) from None
    if not create:
        raise NoSuchBucket(f"bucket {storage.bucket!r} does not exist at {_where(storage)}")
    kwargs = {} if storage.region == "us-east-1" else {
        "CreateBucketConfiguration": {"LocationConstraint": storage.region}}
    try:
        s3.create_bucket(Bucket=storage.bucket, **kwargs)
    except (BotoCoreError, ClientError) as err:
        raise failure(err, f"creating bucket {storage.bucket!r} at {_where(storage)}", storage) from None


def repo_prefix(storage: Storage, digest: str) -> str:
    return f"{storage.prefix}/repos/{digest[:24]}"


def signature_key(storage: Storage, digest: str) -> str:
    """The build's signature, beside (not inside) its model_repository: Triton never sees it."""
    return f"{repo_prefix(storage, digest)}/{SIGNATURE}"


def run_manifest_key(storage: Storage, run_id: str) -> str:
    return f"{storage.prefix}/runs/{run_id}/manifest.json"


def triton_uri(storage: Storage, key: str) -> str:
    """The --model-repository value Triton understands for this key."""
    if storage.endpoint_url:
        u = urlparse(storage.endpoint_url)
        host = u.netloc
        # Triton's S3 path syntax for a custom endpoint: s3://host:port/bucket/path (http),
        # s3://https://host:port/bucket/path (TLS).
        scheme = "https://" if u.scheme == "https" else ""
        return f"s3://{scheme}{host}/{storage.bucket}/{key}"
    return f"s3://{storage.bucket}/{key}"


def _sizes(s3, bucket: str, prefix: str) -> dict[str, int]:
    """Every object under prefix with its size."""
    out: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def _expected(base: str, files: dict[str, int], empty_dirs: list[str]) -> dict[str, int]:
    """The objects (key → size) of a complete upload under base: its files and the empty folders' placeholders."""
    return files | {f"{base}/{d.strip('/')}/": 0 for d in empty_dirs}


def read_marker(s3, storage: Storage, digest: str) -> dict | None:
    """The completed upload's marker, or None when no complete upload of this digest exists.

    A marker counts only while every object it lists is there with its size: a cleanup that raced a
    marker write (a frozen server applying it late) then means "upload again", never a broken repository.
    """
    prefix = repo_prefix(storage, digest)
    try:
        body = s3.get_object(Bucket=storage.bucket, Key=f"{prefix}/{MARKER}")["Body"].read()
        try:
            marker = json.loads(body)
        except ValueError:
            return None
        if not isinstance(marker, dict) or marker.get("digest") != digest:
            return None
        present = _sizes(s3, storage.bucket, f"{prefix}/model_repository/")
    except ClientError as err:
        if _code(err) in _MISSING_CODES:
            return None
        raise failure(err, f"s3://{storage.bucket}/{prefix}/{MARKER}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"s3://{storage.bucket}/{prefix}/{MARKER}", storage) from None
    want = _expected(f"{prefix}/model_repository", {o["key"]: o["bytes"] for o in marker.get("objects", [])},
                     marker.get("empty_dirs", []))
    return marker if all(present.get(k) == n for k, n in want.items()) else None


def _remote_sha(s3, bucket: str, key: str) -> str | None:
    try:
        return s3.head_object(Bucket=bucket, Key=key).get("Metadata", {}).get("sha256")
    except ClientError as err:
        if _code(err) in _MISSING_CODES or _code(err) == "403":
            return None  # 403: no ListBucket right, S3 then hides whether the key exists
        raise


def upload_tree(s3, storage: Storage, local_root: Path, records: list[FileRecord], empty_dirs: list[str],
                digest: str, progress: Callable[[str], None], keep_sent: bool = False,
                signature: bytes | None = None) -> list[UploadedObject]:
    """Upload a repository in parallel, then publish it: the signature (when given), then the completion marker.

    Before the marker, one listing checks that every object is there (a concurrent cleanup cannot leave a
    marker over a half repository) and removes anything else under the repository's folder (leftovers of an
    earlier attempt). Identical objects already there are skipped, so a retry sends only what is missing.

    On failure nothing is left under the repository's prefix (`discard_upload`), unless `keep_sent` and the
    failure is transient: then what arrived stays for the caller's retry to skip, and the caller discards
    it when its last attempt fails (the upload task does).

    Raises:
        S3Unreachable: the endpoint stalled, dropped connections or was busy through every retry.
        S3Error: credentials, permissions, the bucket, or anything else a retry cannot heal.
    """
    prefix = repo_prefix(storage, digest)
    base = f"{prefix}/model_repository"
    expected = _expected(base, {f"{base}/{r.path}": r.bytes for r in records}, empty_dirs)
    results: list[UploadedObject | None] = [None] * len(records)
    total = sum(r.bytes for r in records)
    stop = threading.Event()

    bytes_out = Progress("upload", total, "B", progress)
    say = bytes_out.printer(progress)

    def one(rec: FileRecord) -> UploadedObject:
        key = f"{base}/{rec.path}"
        share = bytes_out.share(rec.bytes)
        if stop.is_set():  # another file failed: start nothing new
            raise _Stopped
        if _remote_sha(s3, storage.bucket, key) == rec.sha256:
            share.complete()
            return UploadedObject(key, rec.sha256, rec.bytes, True)
        if stop.is_set():
            raise _Stopped
        # s3transfer calls back with the bytes sent, from its own threads (and with negative counts on a retry).
        s3.upload_file(str(local_root / rec.path), storage.bucket, key, Config=_TRANSFER,
                       ExtraArgs={"Metadata": {"sha256": rec.sha256}}, Callback=share)
        share.complete()
        return UploadedObject(key, rec.sha256, rec.bytes, False)

    try:
        # The pool's exit waits for uploads still in flight, so none of ours lands after the cleanup below.
        with bytes_out, ThreadPoolExecutor(max_workers=_FILES_AT_ONCE) as pool:
            futures = {pool.submit(one, rec): i for i, rec in enumerate(records)}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    if fut.exception() is not None:
                        stop.set()
                        raise fut.exception()
                    results[futures[fut]] = fut.result()
        skipped = [o for o in results if o is not None and o.skipped]
        say(f"upload: {len(records)} files, {total / 1e6:.1f} MB: {len(records) - len(skipped)} sent, "
            f"{len(skipped)} identical (skipped, {sum(o.bytes for o in skipped) / 1e6:.1f} MB)")
        # Triton fails to load a model whose version folder has no object at all.
        for d in empty_dirs:
            s3.put_object(Bucket=storage.bucket, Key=f"{base}/{d.strip('/')}/", Body=b"")
        _check_complete(s3, storage, base, expected, progress)
        done = [o for o in results if o is not None]
        if signature is not None:  # one PUT (atomic): the marker that makes the build visible comes after it
            s3.put_object(Bucket=storage.bucket, Key=signature_key(storage, digest), Body=signature,
                          ContentType="application/json")
        marker = {"digest": digest, "objects": [o.__dict__ for o in done], "empty_dirs": empty_dirs}
        s3.put_object(Bucket=storage.bucket, Key=f"{prefix}/{MARKER}",
                      Body=json.dumps(marker, indent=1).encode(), ContentType="application/json")
    except Exception as err:  # noqa: BLE001 - classified below, and the prefix cleaned up
        error = failure(err, f"upload to s3://{storage.bucket}/{base} failed", storage)
        progress(f"upload: {error}")
        if not (keep_sent and isinstance(error, TransientError)):
            discard_upload(storage, digest, progress, expected)
        raise error from None
    _abort_uploads(s3, storage.bucket, prefix + "/")
    return done


class _Stopped(Exception):
    """A queued file that was not started because another one failed."""


def _check_complete(s3, storage: Storage, base: str, expected: dict[str, int],
                    progress: Callable[[str], None]) -> None:
    present = _sizes(s3, storage.bucket, base + "/")
    missing = [k for k, n in expected.items() if present.get(k) != n]
    if missing:
        raise S3Unreachable(f"{len(missing)} uploaded objects are missing or short, e.g. {missing[0]} "
                            "(removed while uploading?)")
    stale = sorted(set(present) - set(expected))
    if stale:
        progress(f"upload: removing {len(stale)} stale objects under s3://{storage.bucket}/{base}/")
        _delete(s3, storage.bucket, stale)


def _delete(s3, bucket: str, keys: list[str]) -> None:
    """Delete keys; raises when S3 refuses any of them."""
    for i in range(0, len(keys), 1000):
        answer = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                                          "Quiet": True})
        for e in answer.get("Errors", []):
            raise ClientError({"Error": {"Code": e.get("Code", ""), "Message": e.get("Message", "")}},
                              "DeleteObjects")


def discard_upload(storage: Storage, digest: str, progress: Callable[[str], None],
                   known: dict[str, int] | None = None) -> int:
    """Remove an unfinished upload of `digest`: every object and multipart upload under its prefix.

    Returns how many objects remain (0 also when a complete upload turns out to be there: a marker write
    that a frozen server applied late, or another publisher's, is a repository, not litter). Best effort
    within a window of twice the read timeout (at least 10 s): a stalled server is retried until it answers
    and the prefix has stayed empty for a moment. Without the right to list, the `known` keys are deleted.
    """
    prefix = repo_prefix(storage, digest)
    where = f"s3://{storage.bucket}/{prefix}/"
    progress(f"upload: removing everything under {where}")
    s3 = client(storage, attempts=1)  # this loop is the retry: one try per round keeps the window honest
    deadline = time.monotonic() + max(10.0, 2 * timeouts()[1])
    empty_since: float | None = None
    left = len(known or {})
    while True:
        try:
            if read_marker(s3, storage, digest) is not None:
                progress(f"upload: {where} holds a complete upload after all; kept")
                return 0
            keys = list(_sizes(s3, storage.bucket, prefix + "/"))
            uploads = _uploads(s3, storage.bucket, prefix + "/")
            left = len(keys)
            if keys or uploads:
                empty_since = None
                _delete(s3, storage.bucket, keys)
                for key, upload_id in uploads:
                    s3.abort_multipart_upload(Bucket=storage.bucket, Key=key, UploadId=upload_id)
            elif empty_since is None:
                empty_since = time.monotonic()
            elif time.monotonic() - empty_since >= _QUIET_S:
                progress(f"upload: nothing left under {where}")
                return 0
        except (BotoCoreError, ClientError, StokerError) as err:
            if not isinstance(failure(err, "cleanup", storage), TransientError):
                left = _delete_known(s3, storage.bucket, known) if known else left
                break
            empty_since = None
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    if left:
        progress(f"upload: {left} objects could not be removed from {where} (no marker, so nothing uses them; "
                 "the next upload of this digest replaces them)")
    return left


def _delete_known(s3, bucket: str, known: dict[str, int]) -> int:
    try:
        _delete(s3, bucket, sorted(known))
        return 0
    except (BotoCoreError, ClientError):
        return len(known)


def _abort_uploads(s3, bucket: str, prefix: str) -> None:
    """Abort the unfinished multipart uploads under a published repository's prefix, best effort: they are
    what an abandoned attempt (or a request a frozen server applied late) left, and S3 bills their parts."""
    try:
        for key, upload_id in _uploads(s3, bucket, prefix):
            s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    except (BotoCoreError, ClientError):
        pass


def _uploads(s3, bucket: str, prefix: str) -> list[tuple[str, str]]:
    """Unfinished multipart uploads under prefix: (key, upload id)."""
    out: list[tuple[str, str]] = []
    for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        out += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
    return out


def put_json(s3, storage: Storage, key: str, obj: dict) -> str:
    try:
        s3.put_object(Bucket=storage.bucket, Key=key, Body=json.dumps(obj, indent=1, sort_keys=True).encode(),
                      ContentType="application/json")
    except (BotoCoreError, ClientError) as err:
        raise failure(err, f"writing s3://{storage.bucket}/{key}", storage) from None
    return f"s3://{storage.bucket}/{key}"


def baseline_key(storage: Storage, deployment: str) -> str:
    """The deployment's benchmark baseline: the summary of its last promoted run."""
    return f"{storage.prefix}/deployments/{deployment}/baseline.json"


def run_key(storage: Storage, run_id: str, name: str) -> str:
    return f"{storage.prefix}/runs/{run_id}/{name}"


def get_json(s3, storage: Storage, key: str) -> dict | None:
    """The JSON object at `key`, or None when there is none."""
    try:
        body = s3.get_object(Bucket=storage.bucket, Key=key)["Body"].read()
    except ClientError as err:
        if _code(err) in _MISSING_CODES:
            return None
        raise failure(err, f"s3://{storage.bucket}/{key}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"s3://{storage.bucket}/{key}", storage) from None
    return json.loads(body)


def put_object_bytes(s3, storage: Storage, key: str, body: bytes) -> str:
    """One PUT of ``body`` at ``key`` (S3 makes it visible whole or not at all)."""
    try:
        s3.put_object(Bucket=storage.bucket, Key=key, Body=body, ContentType="application/json")
    except (BotoCoreError, ClientError) as err:
        raise failure(err, f"writing s3://{storage.bucket}/{key}", storage) from None
    return f"s3://{storage.bucket}/{key}"


def get_bytes(s3, storage: Storage, key: str) -> bytes | None:
    """The object at `key`, or None when there is none."""
    try:
        return s3.get_object(Bucket=storage.bucket, Key=key)["Body"].read()
    except ClientError as err:
        if _code(err) in _MISSING_CODES:
            return None
        raise failure(err, f"s3://{storage.bucket}/{key}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"s3://{storage.bucket}/{key}", storage) from None


def object_sha256s(s3, storage: Storage, base: str) -> dict[str, str]:
    """Every object under ``base/`` (folder placeholders aside) by its path below base, with the sha256 of its bytes
    as S3 serves them now: read in full, never taken from the object's metadata, which its writer sets."""
    out: dict[str, str] = {}
    try:
        for key in sorted(_sizes(s3, storage.bucket, base + "/")):
            if key.endswith("/"):
                continue
            h = hashlib.sha256()
            body = s3.get_object(Bucket=storage.bucket, Key=key)["Body"]
            for chunk in iter(lambda: body.read(1 << 20), b""):
                h.update(chunk)
            out[key.removeprefix(base + "/")] = h.hexdigest()
    except (BotoCoreError, ClientError) as err:
        raise failure(err, f"reading s3://{storage.bucket}/{base}", storage) from None
    return out


def put_file(s3, storage: Storage, key: str, path: Path, content_type: str) -> str:
    try:
        s3.put_object(Bucket=storage.bucket, Key=key, Body=path.read_bytes(), ContentType=content_type)
    except (BotoCoreError, ClientError) as err:
        raise failure(err, f"writing s3://{storage.bucket}/{key}", storage) from None
    return f"s3://{storage.bucket}/{key}"
