"""The Python search API without Ray: `from service import Search, SearchSpace`, config objects instead of
flat keyword arguments, and a `SearchResult` that is public, rankable and frozen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from service.search.prune import PrunedPlan
from service.search.result import TrialRecord
from service.spec import Plan, SpecError

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = REPO / "experiments" / "tiny-cpu.yaml"


def test_top_level_names_import_lazily() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from service import Search, SearchSpace, SearchConfig, SearchResult; "
        "print(Search.__module__, SearchSpace.__module__, 'ray' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["service.search.driver", "service.search.space", "False", "False"]


def test_config_objects_set_the_search_and_the_space_fills_the_rest(tmp_path: Path) -> None:
    from service import Search, SearchConfig, SearchSpace
    from service.search import RunConfig

    space = SearchSpace(params={"zero_stage": [0, 1], "micro_batch": [2, 4]}, algorithm="random", patience=2)
    search = Search(
        EXPERIMENT,
        space,
        config=SearchConfig(algorithm="bayes", max_trials=3, steps=4, seed=7, guided=False),
        run_config=RunConfig(storage_path=tmp_path, name="a"),
    )
    assert (search.algorithm, search.max_trials, search.steps, search.seed, search.guided) == (
        "bayes",
        3,
        4,
        7,
        False,
    )
    assert search.patience == 2  # not given: the space's
    assert search.path == tmp_path.resolve() / "a"
    default = Search(EXPERIMENT, space, run_config=RunConfig(storage_path=tmp_path))
    assert default.algorithm == "random" and default.guided is True


def test_settings_come_only_as_config_objects(tmp_path: Path) -> None:
    from service import Search, SearchConfig, SearchSpace

    space = SearchSpace(params={"zero_stage": [0, 1]})
    with pytest.raises(TypeError, match="max_trials"):  # as Ray Tune's Tuner: no flat keyword arguments
        Search(EXPERIMENT, space, max_trials=3)  # type: ignore[call-arg]
    with pytest.raises(SpecError) as info:
        SearchConfig(algorithm="anneal")
    assert info.value.field == "algorithm"


def _trial(trial_id: str, micro_batch: int, status: str, tokens: float, peak: float) -> TrialRecord:
    plan = Plan(dp=2, micro_batch=micro_batch, precision="fp32")
    measured = {"tokens_per_s": tokens, "peak_memory_bytes_per_rank": peak}
    return TrialRecord(
        trial_id=trial_id, key=plan.short(), plan=plan, status=status, steps=4, measured=measured
    )


def test_result_ranks_by_any_metric_and_is_frozen() -> None:
    from service import SearchResult

    trials = [
        _trial("a", 1, "ok", 800.0, 3e8),
        _trial("b", 2, "ok", 1200.0, 5e8),
        _trial("c", 4, "stopped_early", 2000.0, 9e8),  # did not run every step: never ranked
        _trial("d", 8, "ok", 1000.0, 4e8),
    ]
    pruned = [PrunedPlan({"tp": 4}, "dp·tp·pp = 8 but the proxy has 2 workers", "invalid")]
    result = SearchResult("tokens_per_s", "max", trials, pruned, "run1", "/tmp/s")
    assert [t.trial_id for t in result.ranking] == ["b", "d", "a"]
    assert result.best is result.get_best_result() and result.best.trial_id == "b"
    assert result.get_best_result("tokens_per_s", "min").trial_id == "a"
    assert result.get_best_result("peak_memory_bytes_per_rank", "min").trial_id == "a"
    assert [t.trial_id for t in result.rank("peak_memory_bytes_per_rank", "max")] == ["b", "d", "a"]
    assert result.get_best_result("loss") is None  # no trial measured it
    with pytest.raises(ValueError, match="mode"):
        result.rank(mode="best")
    df = result.get_dataframe()
    assert list(df["trial_id"]) == ["a", "b", "c", "d"] and df.loc[1, "measured_tokens_per_s"] == 1200.0

    trials.append(_trial("e", 16, "ok", 5000.0, 1e8))  # the caller's list changes ...
    assert len(result.trials) == 4 and result.best.trial_id == "b"  # ... the result does not
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.trials = []  # type: ignore[misc]
