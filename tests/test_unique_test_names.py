"""Test files have unique basenames: pytest imports them by basename (no __init__.py in tests/), so a
second `test_x.py` in another folder fails the whole suite's collection ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_files_share_a_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
