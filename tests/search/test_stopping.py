"""No-improvement stop (driven through its Tune callback hooks) and the ASHA settings."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from service.search.space import AshaSettings
from service.search.stopping import NoImprovementStop, asha


def end(stop: NoImprovementStop, trial_id: str, value: float | None, status: str = "ok") -> None:
    trial = SimpleNamespace(trial_id=trial_id)
    if value is not None:
        stop.on_trial_result(0, [], trial, {stop.metric: value, "step": 5.0, "last_step": 1.0})
    stop.on_trial_result(0, [], trial, {"trial_status": status, "done": 1.0})
    stop.on_trial_complete(0, [], trial)


def test_stops_after_patience_trials_without_a_new_best() -> None:
    stop = NoImprovementStop("tokens_per_s", "max", patience=2)
    end(stop, "a", 100.0)
    assert stop.best == 100.0 and not stop.stop_all()
    end(stop, "b", 90.0)
    assert stop.since_best == 1 and not stop.stop_all()
    end(stop, "c", 120.0)  # improvement resets the count
    assert stop.best == 120.0 and stop.since_best == 0
    end(stop, "d", None, status="oom")  # an infeasible trial is "no improvement"
    end(stop, "e", 119.0)
    assert stop.stop_all() and stop.since_best == 2


@pytest.mark.parametrize("status", ["unschedulable", "killed"])
def test_a_trial_that_never_reached_a_verdict_uses_no_patience(status: str) -> None:
    stop = NoImprovementStop("tokens_per_s", "max", patience=1)
    end(stop, "a", 100.0)
    end(stop, "b", None, status=status)  # the cluster never placed it, or lost its node
    assert stop.since_best == 0 and not stop.stop_all()
    end(stop, "c", 90.0)
    assert stop.stop_all()


def test_a_trial_stopped_early_cannot_be_the_best_and_ends_count_once() -> None:
    stop = NoImprovementStop("step_time_s", "min", patience=3)
    end(stop, "a", 2.0)
    trial = SimpleNamespace(trial_id="b")
    # ASHA stopped it at step 3; Tune marks that last result `done` all the same.
    stop.on_trial_result(0, [], trial, {"step_time_s": 1.0, "step": 3.0, "last_step": 0.0, "done": True})
    stop.on_trial_complete(0, [], trial)
    stop.on_trial_error(0, [], trial)  # a second notice for the same trial is ignored
    assert stop.best == 2.0 and stop.since_best == 1


def test_no_patience_never_stops() -> None:
    stop = NoImprovementStop("tokens_per_s", "max", patience=None)
    for i in range(10):
        end(stop, str(i), 1.0)
    assert not stop.stop_all()


def test_asha_grace_period_defaults_to_three_steps_after_warmup() -> None:
    scheduler = asha(AshaSettings(), "tokens_per_s", "max", steps=12, warmup_steps=2)
    assert scheduler is not None
    assert scheduler._time_attr == "step" and scheduler._max_t == 11  # never a rung on the last step
    assert [r[0] for r in scheduler._brackets[0]._rungs] == [10, 5]  # first rung: 3 measured steps' mean
    given = asha(AshaSettings(grace_period=3), "tokens_per_s", "max", steps=8, warmup_steps=2)
    assert [r[0] for r in given._brackets[0]._rungs] == [6, 3]  # a space's own grace period is kept
    assert not scheduler._stop_last_trials
    assert asha(None, "tokens_per_s", "max", steps=8, warmup_steps=2) is None
    assert asha(AshaSettings(), "tokens_per_s", "max", steps=5, warmup_steps=2) is None  # no room for a rung


@pytest.mark.slow  # a local Ray instance (about 10 s)
def test_orphaned_placement_groups_of_dead_actors_are_freed() -> None:
    """What a trial stopped mid-run leaves: its controller's placement group. The sweep frees it and
    nothing else (not a group the driver made, not one whose creator is alive)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table

    from service.search.stopping import remove_orphaned_placement_groups

    ray.init(address="local", num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        driver_pg = placement_group([{"CPU": 0.5}])
        ray.get(driver_pg.ready())

        @ray.remote(num_cpus=0)
        class Controller:
            def reserve(self) -> str:
                pg = placement_group([{"CPU": 1}, {"CPU": 1}])
                ray.get(pg.ready())
                return pg.id.hex()

        controller = Controller.remote()
        workers_pg = ray.get(controller.reserve.remote())
        assert remove_orphaned_placement_groups() == 0  # its creator is alive
        ray.kill(controller)
        deadline = time.monotonic() + 30
        removed = 0
        while not removed and time.monotonic() < deadline:  # the GCS learns of the death shortly after
            time.sleep(0.5)
            removed = remove_orphaned_placement_groups()
        assert removed == 1
        table = placement_group_table()
        assert table[workers_pg]["state"] == "REMOVED"
        assert table[driver_pg.id.hex()]["state"] == "CREATED"
        time.sleep(1)
        assert ray.available_resources()["CPU"] == pytest.approx(2.5)
    finally:
        ray.shutdown()


@pytest.mark.parametrize("metric", ["tokens_per_s", "peak_memory_bytes_per_rank"])
def test_tune_reads_every_search_metric_under_its_name_in_the_workers_report(metric: str) -> None:
    """The search's stop, searcher and ASHA are given `report_key(metric)`: a memory search sees its
    values (the worker reports memory as `measured_...`); under the plain name it would see none."""
    from service.spec.record import report_key

    report = {"step": 5.0, "tokens_per_s": 1.2e3, "measured_peak_memory_bytes_per_rank": 9e8, "last_step": 1}
    for name, seen in ((report_key(metric), True), (metric, metric == "tokens_per_s")):
        stop = NoImprovementStop(name, "max", patience=1)
        trial = SimpleNamespace(trial_id="a")
        stop.on_trial_result(0, [], trial, report)
        stop.on_trial_complete(0, [], trial)
        assert (stop.best is not None) == seen, name
    assert report_key("peak_memory_bytes_per_rank") == "measured_peak_memory_bytes_per_rank"
