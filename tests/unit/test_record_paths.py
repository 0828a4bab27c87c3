"""A shared-cache record names the files to write: only paths inside the entry, each once, with real digests."""

from __future__ import annotations

import pytest

from stoker.storage.digest import FileRecord, unsafe_record

SHA = "a" * 64


@pytest.mark.parametrize("path", ["../../../x", "/etc/x", "a/../../x", "a//b", "./a", "a/.", "", "a\\b", "a\0b"])
def test_paths_that_could_leave_the_entry_are_refused(path):
    assert unsafe_record([FileRecord(path, SHA, 1)], []) == f"unsafe path {path!r}"
    assert unsafe_record([], [path]) == f"unsafe path {path!r}"


def test_digests_sizes_and_repeats_are_checked():
    assert unsafe_record([FileRecord("m/w.bin", SHA, 3), FileRecord("config.json", "b" * 64, 0)], ["ensemble/1"]) is None
    assert unsafe_record([FileRecord("a", "../../blobs/x", 1)], []) == "'a': sha256 '../../blobs/x' is not 64 hex digits"
    assert unsafe_record([FileRecord("a", SHA, -1)], []) == "'a': size -1 is not a byte count"
    assert unsafe_record([FileRecord("a", SHA, True)], []) == "'a': size True is not a byte count"
    assert unsafe_record([FileRecord("a", SHA, 1), FileRecord("a", SHA, 1)], []) == "path 'a' named twice"
