"""The docstring examples of the search API run as tests. Those that need a Ray cluster (`fit()`) are
marked `doctest: +SKIP`; the same calls run for real on the shared search in
tests/search/test_integration_search.py."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

MODULES = [
    "service.search.space",
    "service.search.result",
    "service.search.config",
    "service.search.driver",
    "service.spec.record",
]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # examples name files relative to the repository, as the README does
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
