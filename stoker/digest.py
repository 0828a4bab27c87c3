"""Content digests: the currency of every cache key and manifest output."""

from __future__ import annotations

import hashlib
import json
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
