"""pytest imports test files by basename (no packages under tests/), so two test files of one name in different
folders stop the whole run at collection ("import file mismatch"), as a CI run of this change did."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique_across_the_test_folders():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
