"""Publishing without half-states: a small text file replaced atomically, and an entry of a cache folder made once
by whichever process of this host gets there first."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, text: str) -> Path:
    """Write to a temp name in the same folder, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def make_once(entry: Path, complete: Callable[[], bool], make: Callable[[], None]) -> bool:
    """Run ``make`` unless ``complete()``, one process of this host at a time: an exclusive lock on a file beside
    ``entry``, which the kernel releases if its holder dies. ``make`` publishes last (a rename, or the file that
    ``complete`` looks for), so a crash part-way leaves an entry that is made again. True when this call made it."""
    import fcntl

    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{entry}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete():
            return False
        make()
        return True
