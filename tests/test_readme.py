"""README's Python block runs as written, against the real API.

The planner part runs for real (milliseconds). `Run.fit()` (the main job, minutes) and `Search.fit()`
(proxy trials on Ray) are replaced by results made here: their constructors still validate every
argument the README passes, and the calls the README makes on their results run on a real
`SearchResult` and are checked against `RunResult`'s fields. (Both `fit()`s run for real in
tests/design and tests/search.)"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)


def test_readme_has_a_python_block() -> None:
    assert python_blocks()


@pytest.mark.parametrize("block", python_blocks())
def test_readme_python_block_runs(block: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.design.job import Run
    from service.report.result import RunResult
    from service.search.driver import Search
    from service.search.result import SearchResult, TrialRecord

    def run_fit(self: Run) -> SimpleNamespace:
        answer = {"selected_label": "dp32-tp1-pp1-z3-mb1-ga4-rc:none", "predicted": {"dollars": 1.0}}
        answer["memo_paths"] = {"html": "memo.html"}
        assert set(answer) <= set(RunResult.model_fields)  # the README reads fields that exist
        return SimpleNamespace(**answer)

    def search_fit(self: Search) -> SearchResult:
        plans = [c.plan for c in self.pruning().candidates][:2]  # the README's space, pruned for real
        trials = [
            TrialRecord(trial_id=f"t{i}", key=p.short(), plan=p, status="ok", steps=4,
                        measured={"tokens_per_s": 1000.0 + i})
            for i, p in enumerate(plans)
        ]  # fmt: skip
        return SearchResult("tokens_per_s", "max", trials, [], None, str(self.path))

    monkeypatch.setattr(Run, "fit", run_fit)
    monkeypatch.setattr(Search, "fit", search_fit)
    monkeypatch.chdir(REPO)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_readme_is_a_guide_under_10_kb() -> None:
    """The README is what a user reads first: under 10 kB, and no CI timings or run logs in it."""
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) < 10_000
    assert not re.search(r"pytest took|\d+ passed|CI (took|ran)", text)
