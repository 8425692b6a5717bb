"""The docstring examples of the search API run as tests. Those that need a Ray cluster (`fit()`) are
marked `doctest: +SKIP`; the same calls run for real on the shared search in
tests/search/test_integration_search.py."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["service.search.space", "service.search.result", "service.search.config"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
