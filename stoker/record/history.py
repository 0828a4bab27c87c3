"""A deployment's run history: the run manifests every run stores in S3 (`<prefix>/runs/<run_id>/manifest.json`,
tasks/s3.py store_manifest), merged with the ones this host keeps under `$STOKER_HOME/runs`.

S3 holds the runs of every host that shares the bucket (fleet workers have homes of their own) and outlives a
wiped home; the local copy is the same record, written first. Rollback records (stoker/record/rollbacks.py,
``kind: rollback``) sit among them and are read alike. Reads only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError

from ..spec.schema import Spec, Storage
from ..storage import s3

MANIFEST = "manifest.json"
_AT_ONCE = 8  # manifests are small: the round trips, not the bytes, are what a long history costs


def runs_root(storage: Storage) -> str:
    """The key prefix run folders live under: stoker.storage.s3.run_manifest_key without the run."""
    return s3.run_manifest_key(storage, "").removesuffix(f"/{MANIFEST}")


def where(storage: Storage) -> str:
    return f"s3://{storage.bucket}/{runs_root(storage)}"


def manifest_keys(keys: list[str], root: str, skip: set[str]) -> dict[str, str]:
    """run id → key, for the keys shaped ``<root><run_id>/manifest.json`` whose run id is not in `skip` (a run's
    other files, reports and evaluations, sit beside its manifest). Pure."""
    out = {}
    for key in keys:
        rest = key.removeprefix(root)
        if rest == key or not rest.endswith(f"/{MANIFEST}"):
            continue
        run_id = rest.removesuffix(f"/{MANIFEST}")
        if run_id and "/" not in run_id and run_id not in skip:
            out[run_id] = key
    return out


def remote_manifests(client, storage: Storage, skip: set[str] = frozenset()) -> list[dict]:
    """Every readable run manifest under the storage's runs prefix, but those of run ids in `skip` (already read
    here); a damaged or vanished one is left out, as read_manifests does locally.

    Raises:
        S3Unreachable: the endpoint refused or stalled through botocore's retries.
        S3Error: credentials, permission, no such bucket.
    """
    return read_remote(client, storage, list_manifests(client, storage, skip))


def list_manifests(client, storage: Storage, skip: set[str] = frozenset()) -> dict[str, str]:
    """run id → key of every run manifest under the storage's runs prefix (one listing, nothing read), but those
    of run ids in `skip`. Raises as remote_manifests."""
    root = runs_root(storage)
    try:
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=storage.bucket,
                                                                                       Prefix=root)
                for o in page.get("Contents", [])]
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") == "NoSuchBucket":
            return {}  # a bucket not made yet (create_bucket: the first run's upload makes it) holds no runs
        raise s3.failure(err, f"listing the run manifests at {where(storage)}", storage) from None
    except BotoCoreError as err:
        raise s3.failure(err, f"listing the run manifests at {where(storage)}", storage) from None
    return manifest_keys(keys, root, set(skip))


def read_remote(client, storage: Storage, wanted: dict[str, str]) -> list[dict]:
    """The readable manifests of `wanted` (run id → key, as list_manifests gives), in its order; a damaged or
    vanished one, or one whose run id is not its folder's, is left out. Raises as remote_manifests."""

    def read(key: str) -> dict | None:
        try:
            m = s3.get_json(client, storage, key)
        except ValueError:  # not JSON: a damaged manifest is no manifest
            return None
        return m if isinstance(m, dict) and isinstance(m.get("run_id"), str) else None

    with ThreadPoolExecutor(max_workers=_AT_ONCE) as pool:
        found = list(pool.map(read, wanted.values()))
    return [m for run_id, m in zip(wanted, found) if m is not None and m["run_id"] == run_id]


def merge(local: list[dict], remote: list[dict]) -> list[dict]:
    """One manifest per run id, oldest first (run ids sort by time); of a run stored in both, the local copy wins
    (the same record: reading it needed no request). Pure."""
    by_id = {m["run_id"]: m for m in remote if isinstance(m.get("run_id"), str)}
    by_id |= {m["run_id"]: m for m in local if isinstance(m.get("run_id"), str)}
    return [by_id[k] for k in sorted(by_id)]


def storages_of(manifests: list[dict], name: str, given: Spec | None = None) -> list[Storage]:
    """Where runs of deployment `name` stored their manifests: each distinct storage its local manifests name (any
    status: a failed run still says where its runs go), newest first, then the given spec's. Pure."""
    out: dict[str, Storage] = {}
    for m in reversed(manifests):
        spec = m.get("spec") or {}
        if (spec.get("deploy") or {}).get("name") != name:
            continue
        try:
            st = Storage.model_validate(spec.get("storage"))
        except ValidationError:  # a manifest of an older schema: its runs are still read locally
            continue
        out.setdefault(st.model_dump_json(), st)
    if given is not None:
        out.setdefault(given.storage.model_dump_json(), given.storage)
    return list(out.values())
