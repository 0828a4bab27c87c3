"""What killed steps leave behind, and when it is safe to remove.

Local: a step writes into `<step>/.tmp-<key>-*/` with an `owner.json` (host, pid) inside; a SIGKILLed step leaves
the folder. It is removed once it is older than a threshold and its owner is known dead (same host, no such pid);
a folder whose owner we cannot check (another host sharing STOKER_HOME, or one written before owners were
recorded) waits for the long threshold, and one whose pid still runs is left alone unless it is a week old (pids
are reused). Remote: blobs under a key with no marker whose newest object (the lease included: a live holder
renews it) is older than the lease ttl, and multipart uploads started longer ago than that. The decisions are here;
the S3 walk that acts on them is remote.sweep_remote (this module stays below the store, which imports it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable

OWNER = "owner.json"
DEAD_OWNER_S = 600.0  # a dead owner's folder: gone after 10 minutes (a restarting step may still want to see it)
UNKNOWN_OWNER_S = 6 * 3600.0  # the store's threshold before owners were recorded
LIVE_OWNER_S = 7 * 86400.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_tmp(age_s: float, owner: dict | None, this_host: str, alive: Callable[[int], bool]) -> bool:
    """Whether a local `.tmp-*` folder of this age and owner is litter. Pure but for `alive`."""
    if owner is None or owner.get("host") != this_host or not isinstance(owner.get("pid"), int):
        return age_s > UNKNOWN_OWNER_S
    if alive(owner["pid"]):
        return age_s > LIVE_OWNER_S
    return age_s > DEAD_OWNER_S


def write_owner(tmp: Path) -> None:
    (tmp / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}))


def _owner(tmp: Path) -> dict | None:
    try:
        d = json.loads((tmp / OWNER).read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def sweep_local(parent: Path, now: float | None = None, dry_run: bool = False) -> list[Path]:
    """Remove (or, dry_run, only name) the litter among parent's `.tmp-*` folders; the ones removed."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    gone = []
    for p in parent.glob(".tmp-*"):
        try:
            age = now - p.stat().st_mtime
        except FileNotFoundError:
            continue
        if sweep_tmp(age, _owner(p), host, pid_alive):
            if not dry_run:
                shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def remote_litter(has_marker: bool, newest_s: float, now: float, ttl_s: float) -> bool:
    """A key folder without a marker whose every object (its lease too) is older than the lease ttl. Pure."""
    return not has_marker and now - newest_s > ttl_s


def stale_upload(initiated_s: float, lease_modified_s: float | None, now: float, ttl_s: float) -> bool:
    """A multipart upload started longer ago than the ttl, under a key nobody holds a live lease on. Pure.

    The lease matters because an upload's own start time is not enough: a big blob of a live builder can take
    longer than the ttl, and moto reports every upload as started in 2010."""
    live_lease = lease_modified_s is not None and now - lease_modified_s <= ttl_s
    return now - initiated_s > ttl_s and not live_lease
