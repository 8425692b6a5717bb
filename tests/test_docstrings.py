"""Every docstring example in the package runs as a test (doctest). Those that need a Ray cluster or a
GPU (`fit()`, a job submission, a production run) are marked `doctest: +SKIP`; the same calls run for
real elsewhere in the suite (e.g. tests/search/test_integration_search.py, tests/design)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules_with_examples() -> list[str]:
    names = []
    for path in sorted((REPO / "service").rglob("*.py")):
        if ">>>" in path.read_text():
            parts = path.relative_to(REPO).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = modules_with_examples()


def test_the_modules_are_found() -> None:
    assert {"service.search.driver", "service.spec.record", "service.planner"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # examples name files relative to the repository, as the README does
    module = importlib.import_module(name)
    examples = [ex for t in doctest.DocTestFinder().find(module) for ex in t.examples]
    runnable = [ex for ex in examples if not ex.options.get(doctest.SKIP)]
    assert examples, f"{name} has '>>>' but no example doctest can find"
    result = doctest.testmod(module, optionflags=OPTIONS)
    assert result.failed == 0 and result.attempted == len(runnable)
