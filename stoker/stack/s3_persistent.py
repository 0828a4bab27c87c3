"""moto's S3 server, made to keep its objects on disk: the local stack's and the demo's S3 survives a restart.

`python -m stoker.stack.s3_persistent --host H --port P --data DIR` serves moto's own S3 app; after every request
that may change something (PUT, POST, DELETE) and before its answer goes out, the buckets and objects that changed
are written under DIR, so what S3 acknowledged is on disk. On start, DIR is loaded back into moto.

Why moto plus a disk layer, and not another server. moto 5.2.5 has no persistence of its own (its request
recorder replays a log of every request, reads included, and cannot replay a multipart upload: the upload ids
differ). The S3 servers that keep data on disk and install here (s3rver from npm) lack what stoker relies on:
conditional writes (`If-None-Match: *`, `If-Match`: the build cache's lease and record, stoker/cache/lease.py) and
multipart listings. So moto stays the S3 semantics (one implementation for tests, demo and stack) and this module
adds only durability.

Layout under DIR, each file written under a temp name, flushed to the disk and renamed:
  blobs/<sha256>                       an object's bytes, shared by every key with the same content
  buckets/<bucket>/bucket.json         {"name", "region"}
  buckets/<bucket>/keys/<sha256(key)>.json   {"key", "blob", "etag", "metadata", "last_modified"}
A key's record is renamed into place after its blob, so a crash never leaves a record over missing bytes; blobs no
record names are removed at start. What is not kept: unfinished multipart uploads, versions, ACLs, tags, policies.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import shutil
import threading
from collections import Counter
from pathlib import Path

import os
import tempfile

_MUTATING = frozenset({"PUT", "POST", "DELETE"})


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write under a temp name, flush it to the disk, rename: a reboot finds the whole file or the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _backends():
    from moto.s3.models import s3_backends

    return s3_backends


def _buckets() -> dict[str, object]:
    """name → moto FakeBucket, across moto's accounts and partitions."""
    s3b = _backends()
    out = {}
    for name, (partition, account) in list(s3b.bucket_accounts.items()):
        bucket = s3b[account][partition].buckets.get(name)
        if bucket is not None:
            out[name] = bucket
    return out


def _keys(bucket) -> dict[str, object]:
    """key → its newest FakeKey (delete markers and other non-objects left out)."""
    from moto.s3.models import FakeKey

    for _ in range(5):  # a concurrent request may change the dict while it is copied: copy again
        try:
            return {k: v for k, v in list(bucket.keys.items()) if isinstance(v, FakeKey)}
        except RuntimeError:
            continue
    return {k: v for k, v in list(bucket.keys.items()) if isinstance(v, FakeKey)}


def _name_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class DiskMirror:
    """What moto holds, mirrored under `root`: sync() after each change, load() once at start."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lock = threading.Lock()
        # bucket → key → (etag, last_modified ISO) as last written: a sync writes only what differs
        self.seen: dict[str, dict[str, tuple[str, str]]] = {}
        self.blob_of: dict[tuple[str, str], str] = {}  # (bucket, key) → the blob its record names
        self.refs: Counter[str] = Counter()  # blob → how many key records name it (a copy shares its source's)

    def _bucket_dir(self, name: str) -> Path:
        return self.root / "buckets" / name

    def load(self) -> int:
        """Recreate every stored bucket and object in moto; returns the number of objects loaded."""
        s3b = _backends()
        from moto.core import DEFAULT_ACCOUNT_ID

        count = 0
        for bdir in sorted((self.root / "buckets").glob("*")) if (self.root / "buckets").is_dir() else []:
            try:
                info = json.loads((bdir / "bucket.json").read_text())
            except (OSError, ValueError):
                continue  # a bucket whose record never landed was never acknowledged
            region = info.get("region") or "us-east-1"
            from moto.utilities.utils import get_partition

            backend = s3b[DEFAULT_ACCOUNT_ID][get_partition(region)]
            backend.create_bucket(info["name"], region)
            seen = self.seen.setdefault(info["name"], {})
            for rec_path in sorted((bdir / "keys").glob("*.json")):
                try:
                    rec = json.loads(rec_path.read_text())
                    value = (self.root / "blobs" / rec["blob"]).read_bytes()
                except (OSError, ValueError, KeyError):
                    continue
                etag = rec["etag"].strip('"')
                fk = backend.put_object(info["name"], rec["key"], value, etag=etag if "-" in etag else None,
                                        disable_notification=True)
                fk.set_metadata(dict(rec.get("metadata") or {}), replace=True)
                fk.last_modified = datetime.datetime.fromisoformat(rec["last_modified"])
                seen[rec["key"]] = (fk.etag, fk.last_modified.isoformat())
                self.blob_of[(info["name"], rec["key"])] = rec["blob"]
                self.refs[rec["blob"]] += 1
                count += 1
        for blob in (self.root / "blobs").glob("*") if (self.root / "blobs").is_dir() else []:
            if not self.refs[blob.name]:
                blob.unlink(missing_ok=True)  # bytes of an object deleted, or of a record that never landed
        return count

    def sync(self) -> None:
        """Write what changed in moto since the last sync; remove what was deleted."""
        with self.lock:
            buckets = _buckets()
            for name in list(self.seen):
                if name not in buckets:  # S3 deletes only empty buckets: its keys were forgotten already
                    shutil.rmtree(self._bucket_dir(name), ignore_errors=True)
                    del self.seen[name]
            for name, bucket in buckets.items():
                bdir = self._bucket_dir(name)
                if name not in self.seen:
                    write_atomic(bdir / "bucket.json", json.dumps({"name": name, "region": bucket.region_name}))
                    self.seen[name] = {}
                seen = self.seen[name]
                now = _keys(bucket)
                for key in [k for k in seen if k not in now]:
                    (bdir / "keys" / f"{_name_of(key)}.json").unlink(missing_ok=True)
                    self._unref(self.blob_of.pop((name, key), None))
                    del seen[key]
                for key, fk in now.items():
                    stamp = (fk.etag, fk.last_modified.isoformat())
                    if seen.get(key) != stamp:
                        self._write(name, key, fk, stamp)
                        seen[key] = stamp

    def _write(self, bucket: str, key: str, fk, stamp: tuple[str, str]) -> None:
        value = fk.value
        blob = hashlib.sha256(value).hexdigest()
        path = self.root / "blobs" / blob
        if not self.refs[blob] or not path.exists():
            write_atomic(path, value)
        write_atomic(self._bucket_dir(bucket) / "keys" / f"{_name_of(key)}.json",
                     json.dumps({"key": key, "blob": blob, "etag": stamp[0], "last_modified": stamp[1],
                                 "metadata": dict(fk.metadata)}))
        self.refs[blob] += 1
        self._unref(self.blob_of.get((bucket, key)))
        self.blob_of[(bucket, key)] = blob

    def _unref(self, blob: str | None) -> None:
        """One key record fewer names ``blob``: its bytes go with the last one."""
        if blob is None:
            return
        self.refs[blob] -= 1
        if self.refs[blob] <= 0:
            del self.refs[blob]
            (self.root / "blobs" / blob).unlink(missing_ok=True)


def app(mirror: DiskMirror):
    """moto's WSGI app, syncing the mirror after each request that may have changed something."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    inner = DomainDispatcherApplication(create_backend_app)

    def wrapped(environ, start_response):
        body = inner(environ, start_response)
        if environ.get("REQUEST_METHOD") in _MUTATING:
            body = list(body)  # moto has applied the request once its answer is produced
            mirror.sync()
        return body

    return wrapped


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data", type=Path, required=True, help="where the objects are kept")
    args = ap.parse_args(argv)
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import make_server

    args.data.mkdir(parents=True, exist_ok=True)
    mirror = DiskMirror(args.data)
    print(f"s3: {mirror.load()} objects loaded from {args.data}", flush=True)
    server = make_server(args.host, args.port, app(mirror), threaded=True, request_handler=MotoRequestHandler)
    server.serve_forever()


if __name__ == "__main__":
    main()
