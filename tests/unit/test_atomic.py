"""stoker.atomic: a file replaced whole, and a cache entry made once by whichever process gets there first."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from stoker.atomic import make_once, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "d" / "f.json"
    write_atomic(path, "old")
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]


def _racer(entry: str, made: str) -> None:
    entry_path = Path(entry)

    def make() -> None:
        with open(made, "a") as f:  # one line per make(): the test counts them
            f.write("x\n")
        time.sleep(0.3)  # long enough for the other process to reach the lock
        (entry_path / "done").parent.mkdir(parents=True, exist_ok=True)
        (entry_path / "done").write_text("ok")

    make_once(entry_path, (entry_path / "done").is_file, make)


def test_two_processes_make_an_entry_once(tmp_path):
    entry, made = tmp_path / "cache" / "e", tmp_path / "made.txt"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_racer, args=(str(entry), str(made))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert made.read_text() == "x\n"
    assert (entry / "done").read_text() == "ok"


def test_a_make_that_fails_leaves_the_entry_to_be_made_again(tmp_path):
    entry = tmp_path / "e"
    complete = (entry / "done").is_file

    def broken() -> None:
        entry.mkdir()
        raise RuntimeError("killed part-way")

    with pytest.raises(RuntimeError):
        make_once(entry, complete, broken)

    def good() -> None:
        (entry / "done").write_text("ok")

    assert make_once(entry, complete, good) is True
    assert make_once(entry, complete, good) is False  # complete now: not made again
