"""How a trial's outcome is read from its reports, the result table, and the per-trial driver's
handling of a run that fails, runs out of memory, or hangs (fake trainers, no Ray)."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.search.prune import PrunedPlan
from service.search.result import SearchResult, TrialRecord, trial_outcome
from service.search.trial import STARTED_EVENT, _earlier_outcome, _fit, workers_placed
from service.spec import Plan
from service.spec.record import Observation

STEP = {"step": 5.0, "loss": 6.1, "tokens_per_s": 1200.0, "measured_peak_memory_bytes_per_rank": 9e8,
        "predicted_tokens_per_s": 8000.0, "predicted_fits": 1.0, "done": 1.0}  # fmt: skip


def test_a_report_becomes_one_typed_observation() -> None:
    report = {**STEP, "trial_status": "ok", "measured_nan": float("nan"), "predicted_x_bytes": 5.0}
    observed = Observation.from_report(report)
    assert observed.measured.model_dump() == {
        "tokens_per_s": 1200.0,
        "loss": 6.1,
        "peak_memory_bytes_per_rank": 9e8,
    }
    assert observed.predicted.tokens_per_s == 8000.0 and observed.predicted.fits == 1.0
    assert observed.predicted["x_bytes"] == 5.0  # a quantity the model adds later is kept, typed float
    assert "nan" not in observed.measured and observed.measured.step_time_s is None
    # MLflow's names are the report's own: the prefixes come back only there.
    assert observed.flat() == {
        "measured_tokens_per_s": 1200.0, "measured_loss": 6.1, "measured_peak_memory_bytes_per_rank": 9e8,
        "predicted_fits": 1.0, "predicted_x_bytes": 5.0, "predicted_tokens_per_s": 8000.0,
    }  # fmt: skip
    assert observed.flat("final_")["final_predicted_fits"] == 1.0
    with pytest.raises(ValidationError):  # frozen
        observed.measured.loss = 1.0  # type: ignore[misc]
    with pytest.raises(KeyError):
        observed.measured["step_time_s"]


def test_trial_outcomes() -> None:
    assert trial_outcome([STEP], None, steps=5) == ("ok", "", 5)
    final = {"trial_status": "oom", "trial_reason": "can't allocate memory", "done": 1.0}
    assert trial_outcome([final], None, steps=5) == ("oom", "can't allocate memory", 0)
    early = {**STEP, "step": 3.0, "done": True, "last_step": 0.0}  # Tune sets `done` on a stopped trial too
    status, reason, step = trial_outcome([early], None, steps=5)
    assert (status, step) == ("stopped_early", 3) and "step 3 of 5" in reason
    status, reason, _ = trial_outcome([], RuntimeError("worker died: CUDA out of memory"), steps=5)
    assert status == "oom" and "out of memory" in reason
    assert trial_outcome([], None, steps=5)[0] == "failed"
    hang = RuntimeError("ray.exceptions.RayTaskError: TrialHang: hang: the trial did not finish within 35 s")
    assert trial_outcome([early], hang, steps=5) == ("hang", "hang: the trial did not finish within 35 s", 3)


def _record(trial_id: str, status: str, tokens: float | None) -> TrialRecord:
    plan = Plan(dp=2, micro_batch=int(tokens or 1) % 7 + 1)
    measured = {} if tokens is None else {"tokens_per_s": tokens}
    return TrialRecord(trial_id=trial_id, key=plan.short(), plan=plan, status=status, measured=measured)


def test_best_is_the_best_trial_that_ran_every_step() -> None:
    trials = [_record("a", "ok", 100.0), _record("b", "stopped_early", 500.0), _record("c", "ok", 300.0),
              _record("d", "oom", None)]  # fmt: skip
    pruned = [PrunedPlan({"tp": 4}, "dp·tp·pp = 8 but the proxy has 2 workers", "invalid")]
    result = SearchResult("tokens_per_s", "max", trials, pruned, "run123", "/tmp/x")
    assert result.best is not None and result.best.trial_id == "c"
    assert result.num_errors == 1 and len(result) == 4
    assert SearchResult("tokens_per_s", "min", trials, [], None, "").best.trial_id == "a"
    df = result.get_dataframe()
    assert list(df["status"]) == ["ok", "stopped_early", "ok", "oom"]
    assert df.loc[2, "measured_tokens_per_s"] == 300.0 and df.loc[2, "dp"] == 2
    data = result.to_dict()
    assert data["best"]["trial_id"] == "c" and data["mlflow_run_id"] == "run123"
    assert data["pruned"][0]["kind"] == "invalid" and data["trials"][3]["status"] == "oom"


def test_a_result_cannot_be_changed_once_built() -> None:
    trials, tracking = [_record("a", "ok", 100.0)], {"uri": "sqlite:///x.db"}
    result = SearchResult("tokens_per_s", "max", trials, [], None, "/tmp/x", tracking=tracking)
    trials.append(_record("b", "ok", 900.0))  # the caller's list is not the result's
    tracking["uri"] = "elsewhere"
    assert [t.trial_id for t in result] == ["a"] and result.tracking["uri"] == "sqlite:///x.db"
    with pytest.raises(AttributeError):
        result.trials.append(_record("c", "ok", 1.0))  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        result.tracking["uri"] = "elsewhere"  # type: ignore[index]
    with pytest.raises(ValidationError):
        result.trials[0].status = "failed"  # type: ignore[misc]
    assert result.to_dict()["tracking"] == {"uri": "sqlite:///x.db"}


def test_a_result_survives_pickling_read_only() -> None:
    # A driver in another process hands its result over (tests/search/conftest.py::tiny_search does).
    trials = [_record("a", "ok", 100.0), _record("b", "oom", None)]
    pruned = [PrunedPlan({"tp": 4}, "dp·tp·pp = 8 but the proxy has 2 workers", "invalid")]
    result = SearchResult("tokens_per_s", "max", trials, pruned, "run1", "/tmp/x", tracking={"online": True},
                          stopped_reason="all 2 planned trials ran", copied_to="s3://b/search/x")  # fmt: skip
    back = pickle.loads(pickle.dumps(result))
    assert back == result and back.to_dict() == result.to_dict() and back.best.trial_id == "a"
    with pytest.raises(TypeError):
        back.tracking["online"] = False  # type: ignore[index]


class _Clock:
    """Wall-clock seconds that pass only when `_fit` waits: each poll is `step_s`, and `on_tick` runs
    after it (what the cluster does meanwhile). The fit under test runs in its thread for real."""

    def __init__(self, step_s: float = 0.25, on_tick=lambda now: None):  # binary fractions: exact sums
        self.now, self.step_s, self.on_tick = 1_024.0, step_s, on_tick
        self.start = self.now

    def __call__(self) -> float:
        return self.now

    def wait(self, thread: threading.Thread) -> None:
        thread.join(0.001)
        self.now += self.step_s
        self.on_tick(self.now)


class _Trainer:
    """A fit that ends at once (ok, or raising what Ray Train raises) or, "hang", never ends."""

    def __init__(self, behaviour: str):
        self.behaviour = behaviour

    def fit(self) -> None:
        if self.behaviour == "oom":
            raise RuntimeError(
                "Training failed: DefaultCPUAllocator: can't allocate memory: you tried 9e9 bytes"
            )
        if self.behaviour == "crash":
            raise RuntimeError("Worker exited unexpectedly: SIGSEGV")
        if self.behaviour == "hang":
            NEVER.wait()


NEVER = threading.Event()  # never set: a hung fit's daemon thread ends with the test process


def test_fit_classifies_outcomes_and_times_out_hangs(tmp_path: Path) -> None:
    log = tmp_path / "trial.log"
    assert _fit(_Trainer("ok"), 5.0, log) == ("ok", "")
    status, reason = _fit(_Trainer("oom"), 5.0, log)
    assert status == "oom" and "can't allocate memory" in reason
    assert _fit(_Trainer("crash"), 5.0, log)[0] == "failed"
    assert "SIGSEGV" in log.read_text()  # the traceback is kept in the trial log
    clock = _Clock()
    status, reason = _fit(_Trainer("hang"), 0.5, log, clock=clock, wait=clock.wait)
    assert status == "hang" and "did not finish within 0.5 s" in reason
    assert clock.now - clock.start == 0.75  # the first poll past the timeout


class _Scaling:
    num_workers, resources_per_worker, use_gpu = 2, {"CPU": 1}, True


class _PendingTrainer:
    """A fit whose workers wait for a placement that the test's clock decides; it never ends."""

    scaling_config = _Scaling()

    def fit(self) -> None:
        NEVER.wait()


def test_fit_ends_a_trial_whose_workers_are_never_placed_as_unschedulable(tmp_path: Path) -> None:
    clock = _Clock()
    status, reason = _fit(
        _PendingTrainer(), 60.0, tmp_path / "trial.log", pending_timeout_s=0.5, run_dir=tmp_path,
        extra={"x": 1.0}, clock=clock, wait=clock.wait,
    )  # fmt: skip
    assert status == "unschedulable", reason
    assert (
        reason
        == "unschedulable: 2 workers of {'CPU': 1, 'GPU': 1.0, 'x': 1.0} each were not placed within 0.5 s"
    )
    assert clock.now - clock.start == 0.75  # ended by the pending timeout, not by the 60 s one


def test_fit_counts_the_hang_timeout_from_the_placement(tmp_path: Path) -> None:
    # Placed after 1.5 s, longer than the 1 s hang timeout: a clock started at fit() would call the
    # trial a hang before its workers even ran; counted from the placement it is a hang 1 s after it.
    log = tmp_path / "proxy_log.jsonl"
    log.write_text(f'{{"event": "{STARTED_EVENT}", "time": 1.0}}\n')  # stale: an earlier attempt's

    placed_at: list[float] = []

    def place_after_1_5_s(now: float) -> None:
        if now - clock.start >= 1.5 and not placed_at:
            placed_at.append(now)
            with log.open("a") as f:
                f.write(f'{{"event": "{STARTED_EVENT}", "time": {now}}}\n')

    clock = _Clock(on_tick=place_after_1_5_s)
    status, reason = _fit(
        _PendingTrainer(), 1.0, tmp_path / "trial.log", pending_timeout_s=10, run_dir=tmp_path,
        clock=clock, wait=clock.wait,
    )  # fmt: skip
    assert status == "hang" and reason == "hang: the trial did not finish within 1 s"
    # placed at 1.5 s, a hang at the first poll past 1.5 + 1 s
    assert clock.now - clock.start == 2.75
    (placed,) = placed_at
    assert placed - clock.start == 1.5
    assert workers_placed(tmp_path, since=clock.start) and workers_placed(tmp_path, since=placed)
    assert not workers_placed(tmp_path, since=placed + 0.1)  # an earlier attempt's events do not count


def test_unschedulable_trials_are_counted_apart_from_errors() -> None:
    trials = [_record("a", "ok", 100.0), _record("b", "unschedulable", None), _record("c", "hang", None)]
    result = SearchResult("tokens_per_s", "max", trials, [], None, "/tmp/x")
    assert (result.num_errors, result.num_unschedulable) == (1, 1)
    final = {"trial_status": "unschedulable", "trial_reason": "unschedulable: 2 workers ...", "done": 1.0}
    assert trial_outcome([final], None, steps=5) == ("unschedulable", "unschedulable: 2 workers ...", 0)


def test_earlier_outcome_recognises_a_finished_run(tmp_path: Path) -> None:
    assert _earlier_outcome(tmp_path, steps=5) is None
    (tmp_path / "proxy_log.jsonl").write_text(
        '{"event": "start", "step": 0, "time": 1}\n'
        + "".join(f'{{"event": "step", "step": {s}, "loss": 6.0, "time": 2}}\n' for s in range(1, 4))
    )
    assert _earlier_outcome(tmp_path, steps=5) is None  # stopped at step 3 of 5: resume it
    with (tmp_path / "proxy_log.jsonl").open("a") as f:
        for s in (4, 5):
            f.write(f'{{"event": "step", "step": {s}, "loss": 5.9, "time": 4}}\n')
    assert _earlier_outcome(tmp_path, steps=5) == ("ok", "", {})
    (tmp_path / "outcome.json").write_text('{"status": "oom", "reason": "memory limit"}')
    assert _earlier_outcome(tmp_path, steps=5) == ("oom", "memory limit", {})
    with (tmp_path / "proxy_log.jsonl").open("a") as f:  # a step record carries the step's report
        f.write('{"event": "step", "step": 5, "time": 5, "metrics": {"step": 5.0, "tokens_per_s": 900.0}}\n')
    assert _earlier_outcome(tmp_path, steps=5) == (
        "oom",
        "memory limit",
        {"step": 5.0, "tokens_per_s": 900.0},
    )


class InsufficientClusterResourcesError(RuntimeError):
    """Stands in for Ray Train's own (ray.train.v2.api.exceptions): raised before any placement group is
    made when the autoscaler's maximum cannot hold the worker group."""


REFUSAL = 'The worker group requires {"GPU": 16} but the cluster only has a maximum of {"GPU": 8} resources.'


class _TooBigTrainer:
    def fit(self) -> None:
        raise InsufficientClusterResourcesError(f"Insufficient cluster resources.\n{REFUSAL}")


def test_fit_reads_ray_trains_own_capacity_refusal_as_unschedulable(tmp_path: Path) -> None:
    log = tmp_path / "trial.log"
    status, reason = _fit(_TooBigTrainer(), 5.0, log, pending_timeout_s=60, run_dir=tmp_path)
    assert (status, reason) == ("unschedulable", f"unschedulable: {REFUSAL}")
