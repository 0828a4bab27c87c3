"""S3: the one module that talks to object storage (boto3).

Layout under the spec's prefix:
  <prefix>/repos/<digest>/model_repository/...   the Triton repository
  <prefix>/repos/<digest>/stoker-repo.json        written last: "this upload is complete"
  <prefix>/runs/<run_id>/manifest.json            the run manifest
Triton only ever gets pointed at a repository whose completion marker exists.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

from .digest import FileRecord
from .errors import StepError, TransientError
from .spec import Storage

MARKER = "stoker-repo.json"
_TRANSFER = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20, max_concurrency=8)


class S3Unreachable(TransientError):
    pass


class S3Error(StepError):
    pass


@dataclass(frozen=True)
class UploadedObject:
    key: str
    sha256: str
    bytes: int
    skipped: bool  # an identical object was already there


def client(storage: Storage):
    cfg = Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60)
    return boto3.client("s3", endpoint_url=storage.endpoint_url, region_name=storage.region, config=cfg)


def credentials_env() -> dict[str, str]:
    """The AWS settings a Triton container needs to read the repository (secrets: never log these)."""
    keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION")
    return {k: os.environ[k] for k in keys if os.environ.get(k)}


def _where(storage: Storage) -> str:
    return storage.endpoint_url or f"AWS S3 ({storage.region})"


def ensure_bucket(s3, storage: Storage, create: bool) -> None:
    """One-line errors for an unreachable endpoint or a missing bucket, before any upload."""
    try:
        s3.head_bucket(Bucket=storage.bucket)
        return
    except EndpointConnectionError:
        raise S3Unreachable(f"S3 endpoint {_where(storage)} is unreachable") from None
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise S3Error(f"bucket {storage.bucket!r} at {_where(storage)}: {code or err}") from None
    if not create:
        raise S3Error(f"bucket {storage.bucket!r} does not exist at {_where(storage)}")
    kwargs = {} if storage.region == "us-east-1" else {
        "CreateBucketConfiguration": {"LocationConstraint": storage.region}}
    s3.create_bucket(Bucket=storage.bucket, **kwargs)


def repo_prefix(storage: Storage, digest: str) -> str:
    return f"{storage.prefix}/repos/{digest[:24]}"


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


def read_marker(s3, storage: Storage, digest: str) -> dict | None:
    """The completed upload's marker, or None when no complete upload of this digest exists."""
    key = f"{repo_prefix(storage, digest)}/{MARKER}"
    try:
        body = s3.get_object(Bucket=storage.bucket, Key=key)["Body"].read()
    except EndpointConnectionError:
        raise S3Unreachable(f"S3 endpoint {_where(storage)} is unreachable") from None
    except ClientError:
        return None
    marker = json.loads(body)
    return marker if marker.get("digest") == digest else None


def _remote_sha(s3, bucket: str, key: str) -> str | None:
    try:
        return s3.head_object(Bucket=bucket, Key=key).get("Metadata", {}).get("sha256")
    except ClientError:
        return None


def upload_tree(s3, storage: Storage, local_root: Path, records: list[FileRecord], empty_dirs: list[str],
                digest: str, progress: Callable[[str], None]) -> list[UploadedObject]:
    """Upload a repository in parallel; the completion marker goes last.

    If anything fails, objects uploaded by this call are deleted again, so no
    incomplete repository is left behind (and without the marker none is used).
    """
    base = f"{repo_prefix(storage, digest)}/model_repository"
    done: list[UploadedObject] = []
    total = sum(r.bytes for r in records)
    sent = 0

    def one(rec: FileRecord) -> UploadedObject:
        key = f"{base}/{rec.path}"
        if _remote_sha(s3, storage.bucket, key) == rec.sha256:
            return UploadedObject(key, rec.sha256, rec.bytes, True)
        s3.upload_file(str(local_root / rec.path), storage.bucket, key, Config=_TRANSFER,
                       ExtraArgs={"Metadata": {"sha256": rec.sha256}})
        return UploadedObject(key, rec.sha256, rec.bytes, False)

    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            for obj in pool.map(one, records):
                done.append(obj)
                sent += obj.bytes
                progress(f"upload {len(done)}/{len(records)} files, {sent / 1e6:.1f}/{total / 1e6:.1f} MB"
                         f"{' (identical, skipped)' if obj.skipped else ''}: {obj.key.rsplit('/', 1)[-1]}")
        # Triton fails to load a model whose version folder has no object at all.
        for d in empty_dirs:
            s3.put_object(Bucket=storage.bucket, Key=f"{base}/{d.strip('/')}/", Body=b"")
        marker = {"digest": digest, "objects": [o.__dict__ for o in done], "empty_dirs": empty_dirs}
        s3.put_object(Bucket=storage.bucket, Key=f"{repo_prefix(storage, digest)}/{MARKER}",
                      Body=json.dumps(marker, indent=1).encode(), ContentType="application/json")
    except (BotoCoreError, ClientError) as err:
        _delete_quietly(s3, storage.bucket, [o.key for o in done if not o.skipped])
        if isinstance(err, EndpointConnectionError):
            raise S3Unreachable(f"S3 endpoint {_where(storage)} is unreachable") from None
        raise S3Error(f"upload to s3://{storage.bucket}/{base} failed: {str(err).splitlines()[0]}") from None
    return done


def _delete_quietly(s3, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):
        try:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        except (BotoCoreError, ClientError):
            pass


def put_json(s3, storage: Storage, key: str, obj: dict) -> str:
    s3.put_object(Bucket=storage.bucket, Key=key, Body=json.dumps(obj, indent=1, sort_keys=True).encode(),
                  ContentType="application/json")
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
    except EndpointConnectionError:
        raise S3Unreachable(f"S3 endpoint {_where(storage)} is unreachable") from None
    except ClientError as err:
        if err.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404", "NotFound"):
            return None
        raise S3Error(f"s3://{storage.bucket}/{key}: {err.response.get('Error', {}).get('Code', err)}") from None
    return json.loads(body)


def put_file(s3, storage: Storage, key: str, path: Path, content_type: str) -> str:
    s3.put_object(Bucket=storage.bucket, Key=key, Body=path.read_bytes(), ContentType=content_type)
    return f"s3://{storage.bucket}/{key}"
