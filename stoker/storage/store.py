"""The local content-addressed step cache: STOKER_HOME/cache/<step>/<key>/.

A step writes into a private temp folder; only a complete result is renamed
into place (rename is atomic on one filesystem), with its record.json inside.
A crash leaves a `.tmp-*` folder that nobody reads and a later publish cleans up (its owner.json names the
process: stoker/cache/sweep.py decides when it is litter).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..cache import sweep
from .digest import FileRecord, records_digest, records_from_json, records_to_json, tree_records

RECORD = "record.json"


@dataclass(frozen=True)
class Entry:
    step: str
    key: str
    path: Path  # the folder holding the step's output files (record.json aside)
    digest: str  # digest over the output files
    files: list[FileRecord]
    detail: dict = field(default_factory=dict)

    @property
    def output_dir(self) -> Path:
        return self.path / "out"


class StepStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def lookup(self, step: str, key: str) -> Entry | None:
        path = self.root / step / key
        try:
            rec = json.loads((path / RECORD).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return Entry(step, key, path, rec["digest"], records_from_json(rec["files"]), rec.get("detail", {}))

    def publish(self, step: str, key: str, produce: Callable[[Path], dict]) -> Entry:
        """Run `produce(out_dir)` in a temp folder and publish it under the key.

        produce returns a JSON-able detail dict stored with the record.
        """
        parent = self.root / step
        parent.mkdir(parents=True, exist_ok=True)
        self._sweep(parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=parent))
        try:
            sweep.write_owner(tmp)
            out = tmp / "out"
            out.mkdir()
            detail = produce(out)
            files = tree_records(out)
            record = {"step": step, "key": key, "digest": records_digest(files),
                      "files": records_to_json(files), "detail": detail, "created_at": time.time()}
            (tmp / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))
            (tmp / sweep.OWNER).unlink()  # a published entry has no owner
            final = parent / key
            if final.exists():  # a concurrent run published the same content first
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        entry = self.lookup(step, key)
        assert entry is not None
        return entry

    @staticmethod
    def _sweep(parent: Path) -> None:
        sweep.sweep_local(parent)
