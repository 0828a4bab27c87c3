"""One builder per cache key across processes and hosts: a lease object next to the entry.

`<prefix>/cache/<step>/<key>/.lease` holds {holder, host, pid, step, key, ttl_s, expires_at}. It is created with a
conditional put (`If-None-Match: *`), so of two processes reaching a key at once exactly one gets it; the holder
renews it every third of its ttl with `If-Match` on the ETag it last wrote, and deletes it (again `If-Match`) when
done. The others wait for the entry's marker.

A holder that died (SIGKILL, a lost host) stops renewing. Staleness is judged on the server's clock only: the
age is the `Date` header of our read minus the lease's `LastModified`, so skewed clocks between hosts do not
matter (`expires_at` in the body is for people reading it). A stale lease is taken over with `If-Match` on its
ETag: of several waiters taking over at once, one wins.

Servers: tested on moto 5.2.5 only; untested on AWS S3, MinIO and Ceph (their documentation says they honour
If-None-Match/If-Match on PutObject). moto answers 412 PreconditionFailed for both, but checks and writes without a
lock; every acquisition therefore reads the lease back and keeps it only when the body names us. s3rver 3.7.1 ignores
both headers, and two holders then both believe they hold the lease (docs/cache-and-fleet.md): not a server for this. A server that refuses `If-Match` on put (501
NotImplemented) gets a best-effort take-over: delete, then the conditional create.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from typing import Callable

from botocore.exceptions import BotoCoreError, ClientError

from ..errors import StepError, StokerError
from ..storage.s3 import failure
from ..spec.schema import Storage

LEASE = ".lease"
_LOST_CODES = ("412", "PreconditionFailed", "404", "NoSuchKey", "NotFound", "ConditionalRequestConflict", "409")


class LeaseLost(StepError):
    """Another process took our lease over (we stalled past its ttl)."""


@dataclass(frozen=True)
class Holder:
    """Who builds: unique per process and attempt."""

    id: str
    host: str
    pid: int

    @classmethod
    def me(cls) -> Holder:
        host = socket.gethostname()
        return cls(f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}", host, os.getpid())


@dataclass(frozen=True)
class Lease:
    step: str
    key: str
    holder: str
    host: str
    pid: int
    ttl_s: float
    expires_at: float
    etag: str = ""  # of the object as we last read or wrote it
    age_s: float = 0.0  # server time since its last write, when read

    def body(self) -> bytes:
        d = {k: v for k, v in asdict(self).items() if k not in ("etag", "age_s")}
        return json.dumps(d, indent=1, sort_keys=True).encode()

    def line(self) -> str:
        return f"{self.holder} (host {self.host}, pid {self.pid})"


# ---- pure decisions ----

def is_stale(age_s: float, ttl_s: float) -> bool:
    """A lease not renewed for longer than its ttl (server clock) belongs to a dead or stalled holder.

    One second of slack: `Date` and `LastModified` have whole-second resolution."""
    return age_s > ttl_s + 1.0


def backoff_s(attempt: int, ttl_s: float) -> float:
    """How long a waiter sleeps before looking again: 0.2 s doubling, at most a quarter of the ttl (and 5 s)."""
    return min(0.2 * (2 ** min(attempt, 10)), max(0.2, min(5.0, ttl_s / 4)))


def server_age_s(last_modified, date_header: str | None, now: float | None = None) -> float:
    """Seconds between the object's LastModified and the server's Date (our clock if the header is missing)."""
    ref = parsedate_to_datetime(date_header).timestamp() if date_header else (now or time.time())
    return max(0.0, ref - last_modified.timestamp())


# ---- the S3 side ----

def lease_key(storage: Storage, step: str, key: str) -> str:
    return f"{storage.prefix}/cache/{step}/{key}/{LEASE}"


def _code(err: ClientError) -> str:
    e = err.response.get("Error", {})
    return str(e.get("Code") or err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def read(s3, storage: Storage, step: str, key: str) -> Lease | None:
    """The lease on step/key as it is now, or None. A body we cannot parse reads as a stale lease."""
    k = lease_key(storage, step, key)
    try:
        r = s3.get_object(Bucket=storage.bucket, Key=k)
        raw = r["Body"].read()
    except ClientError as err:
        if _code(err) in ("404", "NoSuchKey", "NotFound"):
            return None
        raise failure(err, f"reading lease s3://{storage.bucket}/{k}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"reading lease s3://{storage.bucket}/{k}", storage) from None
    age = server_age_s(r["LastModified"], r["ResponseMetadata"].get("HTTPHeaders", {}).get("date"))
    try:
        d = json.loads(raw)
        return Lease(step, key, str(d["holder"]), str(d.get("host", "?")), int(d.get("pid", 0)), float(d["ttl_s"]),
                     float(d.get("expires_at", 0)), r["ETag"], age)
    except (ValueError, KeyError, TypeError):
        return Lease(step, key, "unreadable", "?", 0, 0.0, 0.0, r["ETag"], age)


def _put(s3, storage: Storage, lease: Lease, **cond) -> str | None:
    """Write the lease under a condition; its new ETag, or None when the condition failed."""
    k = lease_key(storage, lease.step, lease.key)
    try:
        return s3.put_object(Bucket=storage.bucket, Key=k, Body=lease.body(), ContentType="application/json",
                             **cond)["ETag"]
    except ClientError as err:
        if _code(err) in _LOST_CODES:
            return None
        raise failure(err, f"writing lease s3://{storage.bucket}/{k}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"writing lease s3://{storage.bucket}/{k}", storage) from None


def _new(step: str, key: str, me: Holder, ttl_s: float) -> Lease:
    return Lease(step, key, me.id, me.host, me.pid, ttl_s, time.time() + ttl_s)


def _confirm(s3, storage: Storage, mine: Lease, etag: str | None) -> Lease | None:
    """Keep a lease we wrote only when reading it back shows our body (moto checks and writes without a lock)."""
    if etag is None:
        return None
    now = read(s3, storage, mine.step, mine.key)
    if now is None or now.holder != mine.holder:
        return None
    return Lease(**(asdict(mine) | {"etag": now.etag}))


def try_acquire(s3, storage: Storage, step: str, key: str, me: Holder, ttl_s: float) -> Lease | None:
    """Create the lease if nobody holds one; ours, or None."""
    mine = _new(step, key, me, ttl_s)
    return _confirm(s3, storage, mine, _put(s3, storage, mine, IfNoneMatch="*"))


def take_over(s3, storage: Storage, stale: Lease, me: Holder, ttl_s: float) -> Lease | None:
    """Replace a stale lease, only if it is still the one we judged stale; ours, or None."""
    mine = _new(stale.step, stale.key, me, ttl_s)
    try:
        etag = _put(s3, storage, mine, IfMatch=stale.etag)
    except StokerError as err:
        if "NotImplemented" not in str(err) and "501" not in str(err):
            raise
        # Best effort for a server without If-Match on put: a waiter that deletes a lease another waiter has just
        # created makes both believe they hold it for a moment; the read-back below settles most such races.
        release(s3, storage, stale)
        return try_acquire(s3, storage, stale.step, stale.key, me, ttl_s)
    return _confirm(s3, storage, mine, etag)


def renew(s3, storage: Storage, lease: Lease) -> Lease:
    """Push the expiry forward. Raises LeaseLost when someone else holds it now."""
    fresh = Lease(**(asdict(lease) | {"expires_at": time.time() + lease.ttl_s}))
    etag = _put(s3, storage, fresh, IfMatch=lease.etag)
    if etag is None:
        raise LeaseLost(f"lease on {lease.step}/{lease.key} was taken over (not renewed within {lease.ttl_s:g} s)")
    return Lease(**(asdict(fresh) | {"etag": etag}))


def release(s3, storage: Storage, lease: Lease) -> None:
    """Delete the lease if it is still the one we know; someone else's is left alone."""
    k = lease_key(storage, lease.step, lease.key)
    try:
        s3.delete_object(Bucket=storage.bucket, Key=k, IfMatch=lease.etag)
    except ClientError as err:
        if _code(err) not in _LOST_CODES:
            raise failure(err, f"releasing lease s3://{storage.bucket}/{k}", storage) from None
    except BotoCoreError as err:
        raise failure(err, f"releasing lease s3://{storage.bucket}/{k}", storage) from None


class Heartbeat:
    """Renews a lease every third of its ttl from a daemon thread while the holder works.

    A renewal that fails for a transient reason is tried again at the next beat (the ttl leaves two more); a lost
    lease is recorded in `lost` and ends the beats: the holder still finishes (the result is content-addressed and
    its marker is written only if none exists), it just no longer keeps others waiting.
    """

    def __init__(self, s3, storage: Storage, lease: Lease, log: Callable[[str], None]):
        self.s3, self.storage, self.lease, self.log = s3, storage, lease, log
        self.lost: str | None = None
        self.stalled = False  # the work went silent: renewals paused (they resume if it speaks again)
        self._builder = threading.get_ident()  # the thread that builds (and runs the step's child, if any)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.step}-{lease.key}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from ..orchestration.child import ACTIVITY

        while not self._stop.wait(self.lease.ttl_s / 3):
            # A hung child (printing nothing for cache_stall_s) must not keep every waiter on this key waiting
            # until its own deadline: the lease is left to expire and a waiter takes the key over.
            silent = ACTIVITY.silent_s(self._builder)
            if silent is not None and silent > self.storage.cache_stall_s:
                if not self.stalled:
                    self.log(f"cache: {self.lease.step}/{self.lease.key}: the step's child printed nothing for "
                             f"{silent:.0f} s (storage.cache_stall_s {self.storage.cache_stall_s:g}); its lease is "
                             "no longer renewed, so a waiter can take the key over")
                self.stalled = True
                continue
            self.stalled = False
            try:
                self.lease = renew(self.s3, self.storage, self.lease)
            except LeaseLost as err:
                self.lost = str(err)
                self.log(f"cache: {err}")
                return
            except StokerError as err:  # S3 blip: the next beat tries again
                self.log(f"cache: renewing the lease on {self.lease.step}/{self.lease.key} failed: {err}")
