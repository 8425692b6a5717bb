"""`SearchResult` / `TrialRecord` shaped like Ray Tune's `ResultGrid` / `Result` (issue #35): an unknown
metric raises, trials have metrics/config/path/checkpoint/error, the grid has errors and
experiment_path, and both print in one short line. No Ray."""

from __future__ import annotations

import pytest

from service.search.result import SearchResult, TrialError, TrialRecord
from service.spec import Plan, SpecError


def _trial(
    trial_id: str, micro_batch: int, status: str, tokens: float | None, reason: str = ""
) -> TrialRecord:
    plan = Plan(dp=2, micro_batch=micro_batch, precision="fp32")
    measured = {"tokens_per_s": tokens, "peak_memory_bytes_per_rank": 1e9} if tokens else {}
    return TrialRecord(trial_id=trial_id, key=plan.short(), plan=plan, status=status, reason=reason, steps=4,
                       measured=measured, path=f"/tmp/s/{trial_id}")  # fmt: skip


@pytest.fixture
def result() -> SearchResult:
    trials = [
        _trial("a", 2, "ok", 900.0),
        _trial("b", 4, "oom", None, "RuntimeError: DefaultCPUAllocator: can't allocate memory " + "x" * 300),
        _trial("c", 8, "killed", None, "killed: worker rank 0 (pid 7) died without an error of its own"),
        _trial("d", 16, "unschedulable", None, "unschedulable: 2 workers of {'CPU': 1} each"),
    ]
    return SearchResult("tokens_per_s", "max", trials, [], None, "/tmp/s")


def test_an_unknown_metric_raises_naming_the_allowed_ones(result: SearchResult) -> None:
    with pytest.raises(ValueError, match="unknown metric 'no_such_metric'; allowed: tokens_per_s") as info:
        result.get_best_result("no_such_metric", "max")
    assert isinstance(info.value, SpecError) and info.value.field == "metric"
    assert result.get_best_result("loss", "min") is None  # a known metric no trial measured
    assert result.get_best_result("measured_tokens_per_s").trial_id == "a"  # the report's name


def test_trials_are_shaped_like_tune_results(result: SearchResult) -> None:
    ok, oom, _killed, unschedulable = result.trials
    assert ok.metrics["tokens_per_s"] == 900.0 and ok.metrics["trial_status"] == "ok"
    assert ok.config["plan"] == ok.key and ok.config["micro_batch"] == 2
    assert ok.path == "/tmp/s/a" and ok.checkpoint is None and ok.error is None
    assert isinstance(oom.error, TrialError) and oom.error.status == "oom"
    assert "can't allocate memory" in str(oom.error)
    assert unschedulable.error is not None  # it never ran: an error of the trial, not of the plan
    assert [e.trial_id for e in result.errors] == ["b", "c"] and result.num_errors == 2
    assert result.num_unschedulable == 1 and result.experiment_path == "/tmp/s"
    assert "checkpoint_path" in ok.to_dict() and ok.to_dict()["path"] == "/tmp/s/a"


def test_results_print_in_one_short_line(result: SearchResult) -> None:
    for shown in (repr(result), str(result), *(repr(t) for t in result.trials), str(result.best)):
        assert len(shown) < 200 and "\n" not in shown, shown
    assert repr(result).startswith("SearchResult(4 trials (1 ok, 1 oom, 1 killed, 1 unschedulable)")
    assert "best=dp2-" in repr(result) and "tokens_per_s=900" in repr(result)


def test_a_killed_trial_is_not_scored_as_infeasible() -> None:
    from service.search.searcher import PlanSearcher

    fields = {"micro_batch": [1, 2]}
    searcher = PlanSearcher([("k1", {"micro_batch": 1}), ("k2", {"micro_batch": 2})], fields, "grid",
                            "tokens_per_s", "max")  # fmt: skip
    assert searcher.suggest("t0") == {"plan": "k1"}
    searcher.on_trial_complete("t0", {"trial_status": "killed", "done": 1.0})
    assert "k1" not in searcher._values  # no penalty: a dead worker says nothing about the plan
    assert searcher.suggest("t1") == {"plan": "k2"}
    searcher.on_trial_complete("t1", {"trial_status": "oom", "done": 1.0})
    assert searcher._values["k2"] == 0.0  # an OOM does
