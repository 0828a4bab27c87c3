"""`stoker sync-repo DEST --bucket … --digest …`: a build's Triton repository from S3 into DEST, verified.

The Kubernetes init container's command (stoker/kubernetes/objects.py): the same download rollback uses
(stoker/serving/mounted_repository.fetch): only a complete upload (its marker, written last, lists every object with
its size), the marker's file list must hash to the digest asked for, each file must match its sha256, nothing else may
arrive, and the copy is renamed into DEST only then. A DEST that already holds the build is kept (a restarted pod).
Keys: boto3's chain (the pod's AWS_* variables from a Secret); they never reach the log.
"""

from __future__ import annotations

import re
from pathlib import Path


def _sync(args) -> int:
    from ..serving.mounted_repository import RepositoryUnavailable, fetch, matches
    from ..spec.schema import Storage

    if not re.fullmatch(r"[0-9a-f]{64}", args.digest):
        raise RepositoryUnavailable(f"--digest {args.digest!r} is not a repository digest (64 hex digits)")
    storage = Storage(bucket=args.bucket, prefix=args.prefix, endpoint_url=args.endpoint_url, region=args.region)
    dest = args.dest.resolve()
    if matches(dest, args.digest):
        print(f"{dest} already holds digest {args.digest[:12]}")
        return 0
    source = fetch(storage, args.digest, dest, print)
    print(f"synced {source} into {dest} (digest {args.digest[:12]}, every file's sha256 checked)")
    return 0


def register(sub) -> None:
    s = sub.add_parser("sync-repo", help="download a build's Triton repository from S3 into DEST, verified against "
                       "its digest (the Kubernetes init container)")
    s.add_argument("dest", type=Path, help="the folder to create (its parent must exist)")
    s.add_argument("--bucket", required=True)
    s.add_argument("--prefix", default="stoker")
    s.add_argument("--endpoint-url", default=None, help="S3 endpoint; default: AWS")
    s.add_argument("--region", default="us-east-1")
    s.add_argument("--digest", required=True, help="the build's repository digest (sha256, 64 hex)")
    s.set_defaults(fn=_sync)
