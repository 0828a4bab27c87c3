"""Leases on the free ports stoker hands out on this host, so two processes never pick the same one.

A port found free is only free until someone binds it; between stoker's choice and the bind (a backend's start after
a build of hours, a server a test starts) another process of this host — a second run, a matrix entry, a test worker
— probing the same range may find it free too. Each pick therefore claims the port: an exclusive `flock` on a file
named after it, in `$STOKER_HOME/port-leases` (mode 0700; `STOKER_PORT_LEASES` names another folder, e.g. one that
several homes of one host share). The lock is the kernel's: two pickers can never both hold it, and it lasts exactly
as long as the process that took it (or until `release`), never a guessed lifetime; a crashed picker frees its ports.
A lease only keeps stoker's own pickers away, never a process that binds the port.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import threading
from pathlib import Path

from ..home import stoker_home

# Leases a process keeps before it lets go of those whose port is bound by now (their job is done): a long-lived
# process (a worker, a test session) would otherwise hold one open file per port it ever picked.
KEEP_UNBOUND = 128

_held: dict[Path, int] = {}  # lease file → the open file (this process's lock on it)
_lock = threading.Lock()


def lease_dir() -> Path:
    env = os.environ.get("STOKER_PORT_LEASES")
    return Path(env) if env else stoker_home() / "port-leases"


def _folder(folder: Path | None) -> Path:
    folder = folder or lease_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # Someone else's folder, or one others may write: their files could stand for our leases.
        raise PermissionError(f"port leases: {folder} must belong to uid {os.getuid()} and be writable by it alone")
    return folder


def held(port: int, folder: Path | None = None) -> bool:
    """Whether a pick of this host (this process included) holds ``port`` now."""
    path = (folder or lease_dir()) / str(port)
    with _lock:
        if path in _held:
            return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own shared lock


def claim(port: int, folder: Path | None = None) -> bool:
    """Hold ``port`` until this process ends or releases it: False when another pick holds it now."""
    path = _folder(folder) / str(port)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    with _lock:
        if path in _held:  # this process held it already: a second pick of the same port is refused too
            os.close(fd)
            return False
        _held[path] = fd
        crowded = len(_held) > KEEP_UNBOUND
    if crowded:
        _let_go_of_bound()
    return True


def release(port: int, folder: Path | None = None) -> None:
    """Give ``port`` back before the process ends (nothing happens for a port it does not hold)."""
    with _lock:
        fd = _held.pop((folder or lease_dir()) / str(port), None)
    if fd is not None:
        os.close(fd)


def _bound(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _let_go_of_bound() -> None:
    with _lock:
        items = list(_held.items())
    for path, _fd in items:
        if path.name.isdigit() and _bound(int(path.name)):
            with _lock:
                fd = _held.pop(path, None)
            if fd is not None:
                os.close(fd)
