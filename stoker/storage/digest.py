"""Content digests: the currency of every cache key and manifest output."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    path: str  # relative, '/'-separated
    sha256: str
    bytes: int


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tree_records(root: Path) -> list[FileRecord]:
    """Every regular file under root with its sha256, sorted by path."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out.append(FileRecord(p.relative_to(root).as_posix(), file_sha256(p), p.stat().st_size))
    return out


def records_digest(records: list[FileRecord]) -> str:
    """One digest for a file set; paths are part of it, so a rename changes it."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.path):
        h.update(f"{r.path}\0{r.sha256}\0{r.bytes}\n".encode())
    return h.hexdigest()


def json_digest(obj: object) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def records_to_json(records: list[FileRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def records_from_json(items: list[dict]) -> list[FileRecord]:
    return [FileRecord(**i) for i in items]


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def unsafe_record(files: list[FileRecord], dirs: list[str]) -> str | None:
    """Why a file set read from elsewhere (a shared-cache record.json) may not be written under a folder, or None.

    Every path must be relative, '/'-separated, normalized (no '', '.', '..' part), without NUL or backslash, and
    name one file once; each sha256 64 lowercase hex (it names an S3 key); each size a non-negative int. Checked
    before anything is written: a planted ``../../x`` or ``/etc/x`` must not land outside the entry.
    """
    seen: set[str] = set()
    for path in [*(f.path for f in files), *dirs]:
        if not isinstance(path, str) or not path or "\0" in path or "\\" in path or path.startswith("/"):
            return f"unsafe path {path!r}"
        if any(part in ("", ".", "..") for part in path.split("/")):
            return f"unsafe path {path!r}"
    for f in files:
        if f.path in seen:
            return f"path {f.path!r} named twice"
        seen.add(f.path)
        if not isinstance(f.sha256, str) or not _SHA256.match(f.sha256):
            return f"{f.path!r}: sha256 {str(f.sha256)[:80]!r} is not 64 hex digits"
        if not isinstance(f.bytes, int) or isinstance(f.bytes, bool) or f.bytes < 0:
            return f"{f.path!r}: size {f.bytes!r} is not a byte count"
    return None
