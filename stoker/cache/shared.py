"""The read-through step cache: local → S3 → (one builder per key) produce, publish locally, upload.

A local hit costs nothing remote. A remote hit downloads into the local store's temp folder and publishes it
there atomically, like a step's own output. A miss takes the key's lease (lease.py) so that of all processes
reaching the key at once only one runs the step; the others wait for its marker and download the result.
The builder releases the lease when done, or when the step fails, so a waiter takes over at once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ..errors import StepError, StokerError
from ..spec.schema import Storage
from ..storage.store import Entry, StepStore
from . import lease as leases
from . import remote

WAIT_LINE_EVERY_S = 30.0  # a waiter repeats its "waiting for" line this often, not at every poll

Log = Callable[[str], None]


class CacheWaitTimeout(StepError):
    """Another builder of the same key kept its lease past storage.cache_wait_s."""


class SharedStore:
    """One step cache over two layers. `s3`, `holder`, `sleep` and `clock` are injectable for tests."""

    def __init__(self, local: StepStore, storage: Storage, s3=None, holder: leases.Holder | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic):
        from ..storage import s3 as s3mod

        self.local, self.storage = local, storage
        self.s3 = s3 if s3 is not None else s3mod.client(storage)
        self.holder = holder or leases.Holder.me()
        self.ttl_s = storage.cache_lease_s
        self._sleep, self._clock = sleep, clock

    def get(self, step: str, key: str, produce: Callable[[Path], dict], log: Log) -> tuple[Entry, str]:
        """The entry for step/key and where it came from: "local", "remote" or "built" (this process ran it)."""
        entry = self.local.lookup(step, key)
        if entry is not None:
            log(f"{step}: cache hit {key} ({len(entry.files)} files)")
            return entry, "local"
        trust_remote = True  # False once the remote entry proved corrupt: then we build and keep our copy
        said, said_at, attempt = None, 0.0, 0
        started = self._clock()
        while True:
            if trust_remote:
                found = remote.lookup(self.s3, self.storage, step, key)
                if found is not None:
                    try:
                        return self._adopt(found, log), "remote"
                    except remote.CorruptEntry as err:
                        log(f"{step}: {err}; building it here")
                        trust_remote = False
                    except StokerError:
                        if remote.lookup(self.s3, self.storage, step, key) is not None:
                            raise  # the entry is intact: S3 itself failed
                        log(f"{step}: shared entry {key} went away while downloading (pruned?); looking again")
                        continue
            mine = leases.try_acquire(self.s3, self.storage, step, key, self.holder, self.ttl_s)
            if mine is None:
                current = leases.read(self.s3, self.storage, step, key)
                if current is None:  # released between our put and our read: look again at once
                    continue
                if leases.is_stale(current.age_s, current.ttl_s):
                    log(f"{step}: stale lease on {key}: {current.line()} stopped renewing {current.age_s:.0f} s ago "
                        f"(ttl {current.ttl_s:g} s); taking it over")
                    mine = leases.take_over(self.s3, self.storage, current, self.holder, self.ttl_s)
                    if mine is None:
                        continue  # another waiter took it over first: wait for that one
                else:
                    waited = self._clock() - started
                    if waited >= self.storage.cache_wait_s:
                        raise CacheWaitTimeout(
                            f"{step}: waited {waited:.0f} s for {current.holder} building {step}/{key}, which still "
                            f"renews its lease (storage.cache_wait_s {self.storage.cache_wait_s:g}); run again later "
                            "or raise the limit")
                    if current.holder != said or self._clock() - said_at >= WAIT_LINE_EVERY_S:
                        log(f"{step}: waiting for {current.holder} building {step}/{key}")
                        said, said_at = current.holder, self._clock()
                    self._sleep(leases.backoff_s(attempt, current.ttl_s))
                    attempt += 1
                    continue
            # The previous holder may have published between our lookup and our lease.
            found = remote.lookup(self.s3, self.storage, step, key) if trust_remote else None
            if found is not None:
                leases.release(self.s3, self.storage, mine)
                continue
            return self._build(mine, step, key, produce, log), "built"

    def _adopt(self, found: remote.RemoteEntry, log: Log) -> Entry:
        log(f"{found.step}: cache hit {found.key} in the shared cache ({len(found.files)} files, "
            f"{found.bytes / 1e6:.1f} MB from {remote.where(self.storage, found.step, found.key)})")
        entry = self.local.publish(found.step, found.key,
                                   lambda out: remote.download(self.s3, self.storage, found, out, log))
        if entry.digest != found.digest:
            raise remote.CorruptEntry(f"cache entry {remote.where(self.storage, found.step, found.key)}: downloaded "
                                      f"digest {entry.digest[:12]} is not the marker's {found.digest[:12]}")
        return entry

    def _build(self, mine: leases.Lease, step: str, key: str, produce: Callable[[Path], dict], log: Log) -> Entry:
        log(f"{step}: cache miss {key}, running (lease held by {mine.holder})")
        beat = leases.Heartbeat(self.s3, self.storage, mine, log)
        try:
            with beat:
                entry = self.local.publish(step, key, produce)
                try:
                    remote.upload(self.s3, self.storage, entry, log)
                except StokerError as err:  # the result is good; only sharing it failed
                    log(f"{step}: not shared: {err} (the result stays in the local cache)")
        finally:
            try:
                leases.release(self.s3, self.storage, beat.lease)
            except StokerError as err:
                log(f"{step}: lease on {key} not released ({err}); it expires in {self.ttl_s:g} s")
        return entry
