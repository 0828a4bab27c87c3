"""Short leases on the free ports stoker hands out on this host, so two processes never pick the same one.

A port found free is only free until someone binds it; between stoker's choice and the bind (a backend's start, a
proxy that comes up after a build of several minutes) another process of this host — a second run, a matrix entry,
a test worker — probing the same range may find it free too. Each pick therefore claims the port for LEASE_S: a file
named after it, created exclusively, in one folder per user. A claim older than that is taken over. Nothing is
locked and nothing needs cleaning: a lease only keeps stoker's own pickers away, never a process that binds the port.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from pathlib import Path

LEASE_S = 900.0  # longer than any build between a port's choice and its bind


def lease_dir() -> Path:
    return Path(os.environ.get("STOKER_PORT_LEASES") or Path(tempfile.gettempdir()) / f"stoker-port-leases-{os.getuid()}")


def held(port: int, now: float | None = None, folder: Path | None = None) -> bool:
    """Whether a pick claimed ``port`` less than LEASE_S ago (nothing is claimed)."""
    try:
        age = (time.time() if now is None else now) - ((folder or lease_dir()) / str(port)).stat().st_mtime
    except FileNotFoundError:
        return False
    return age < LEASE_S


def claim(port: int, now: float | None = None, folder: Path | None = None) -> bool:
    """Claim ``port`` for LEASE_S: False when another pick claimed it less than LEASE_S ago."""
    folder = folder or lease_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        pass
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return claim(port, now, folder)
    if age < LEASE_S:
        return False
    fresh = folder / f".{port}.{uuid.uuid4().hex}"  # an expired lease: replaced by a new file in one rename
    fresh.touch()
    os.replace(fresh, path)
    return True
