"""Does an S3 server honour what the build cache's lease relies on? `python tests/integration/s3_conditional_probe.py
URL BUCKET` (keys from the environment, as boto3 reads them) prints one line per check and exits 1 when any fails.

Checks: a second `If-None-Match: *` put over an existing key is refused; an `If-Match` put and delete with a wrong
ETag are refused; and stoker's own lease (stoker/cache/lease.py) is not granted twice. How docs/cache-and-fleet.md's
"s3rver 3.7.1 ignores both headers" was found; run it against AWS S3, MinIO or Ceph before trusting them with
`shared_cache`. test_s3_persistent.py runs it against the local S3 (moto behind its disk layer).
"""

from __future__ import annotations

import sys
import uuid

import boto3
from botocore.exceptions import ClientError

REFUSED = ("412", "PreconditionFailed", "ConditionalRequestConflict", "409")


def _refused(call) -> bool:
    try:
        call()
    except ClientError as err:
        return str(err.response.get("Error", {}).get("Code")) in REFUSED
    return False


def probe(s3, url: str, bucket: str) -> dict[str, bool]:
    """check → passed, in a fresh folder of ``bucket`` (removed after)."""
    from stoker.cache import lease
    from stoker.spec.schema import Storage

    base = f"stoker-probe-{uuid.uuid4().hex[:8]}"
    key = f"{base}/object"
    s3.put_object(Bucket=bucket, Key=key, Body=b"first")
    out = {
        "If-None-Match: * put over an existing key is refused":
            _refused(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")),
        "If-Match put with a wrong ETag is refused":
            _refused(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"third", IfMatch='"0000"')),
        "If-Match delete with a wrong ETag is refused":
            _refused(lambda: s3.delete_object(Bucket=bucket, Key=key, IfMatch='"0000"')),
    }
    out["the object is still the first write"] = _body(s3, bucket, key) == b"first"
    storage = Storage(bucket=bucket, prefix=base, endpoint_url=url)
    first = lease.try_acquire(s3, storage, "probe", "k", lease.Holder("first", "probe", 1), 60)
    second = lease.try_acquire(s3, storage, "probe", "k", lease.Holder("second", "probe", 2), 60)
    out["stoker's lease is granted once"] = first is not None and second is None
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base + "/"):
        for o in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])
    return out


def _body(s3, bucket: str, key: str) -> bytes | None:
    try:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError:
        return None


def main(argv: list[str]) -> int:
    url, bucket = argv
    results = probe(boto3.client("s3", endpoint_url=url), url, bucket)
    for check, ok in results.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
