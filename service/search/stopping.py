"""When a search stops early: ASHA inside a trial, "no improvement in N trials" across trials.

`NoImprovementStop` is both a Tune `Stopper` (Tune asks it `stop_all()`) and a `Callback` (Tune tells
it when a trial ends, however it ends: finished, stopped by ASHA, errored). The same instance goes in
`RunConfig(stop=..., callbacks=[...])`; Tune pickles both in one experiment state, so a restored
search keeps its count.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ray.tune import Callback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.stopper import Stopper

from service.search.result import NO_VERDICT
from service.search.space import AshaSettings


class NoImprovementStop(Stopper, Callback):
    """Stops the search after `patience` ended trials in a row that did not improve the best metric.

    Only a trial that ran all its steps (`trial_status` ok) can improve the best: a trial that ASHA
    stopped, or that failed, counts as "no improvement".
    """

    def __init__(self, metric: str, mode: str, patience: int | None):
        self.metric, self.mode, self.patience = metric, mode, patience
        self.best: float | None = None
        self.since_best = 0
        self.ended: set[str] = set()
        self._last: dict[str, float] = {}
        self._status: dict[str, str] = {}

    # Stopper
    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.patience is not None and self.since_best >= self.patience

    # Callback
    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        value = result.get(self.metric)
        if isinstance(value, int | float) and math.isfinite(value):
            self._last[trial.trial_id] = float(value)
        if "trial_status" in result:
            self._status[trial.trial_id] = str(result["trial_status"])
        elif result.get("last_step"):  # the worker's last step (its `done`, renamed on the way)
            self._status[trial.trial_id] = "ok"

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended(trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._status[trial.trial_id] = "failed"
        self._ended(trial.trial_id)

    def _ended(self, trial_id: str) -> None:
        if trial_id in self.ended:
            return
        self.ended.add(trial_id)
        value = self._last.get(trial_id)
        if self._status.get(trial_id) in NO_VERDICT:  # the plan did not run: no trial without improvement
            return
        if self._status.get(trial_id) == "ok" and value is not None and self._better(value):
            self.best, self.since_best = value, 0
        else:
            self.since_best += 1

    def _better(self, value: float) -> bool:
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best


RUNG_MEASURED_STEPS = 3


def asha(settings: AshaSettings | None, metric: str, mode: str, steps: int, warmup_steps: int) -> Any:
    """ASHA on the metric by optimizer `step` (stable across a trial's restart, unlike Tune's iteration).

    The grace period defaults to `RUNG_MEASURED_STEPS` steps after warm-up: the worker reports the mean
    since warm-up, and one step's throughput on a shared machine varies by more than plans differ (±45 %
    seen on a 2-core CPU), so the first rung compares a few steps' mean. None when early stopping is off
    or a trial is too short to have rungs.
    Rungs stop short of the last step (max_t = steps - 1, and no stop at max_t): a trial that reached
    its last step ends by itself, so its Train run shuts down cleanly instead of being killed.
    """
    if settings is None:
        return None
    grace = settings.grace_period or warmup_steps + RUNG_MEASURED_STEPS
    if grace >= steps:
        return None
    return ASHAScheduler(
        time_attr="step",
        metric=metric,
        mode=mode,
        max_t=steps - 1,
        grace_period=grace,
        reduction_factor=settings.reduction_factor,
        stop_last_trials=False,
    )


class PlacementGroupSweeper(Callback):
    """Frees the CPUs (GPUs) of trials Tune stopped mid-run (ASHA, the no-improvement stop, a hang).

    A stopped trial's actor dies and takes its Train controller with it, but the placement group the
    controller reserved for its workers lives as long as the job (Ray's rule for non-detached groups).
    Ray Train's own cleaner needs the state API, which cannot tell which cluster to ask when several
    local Ray instances run on one machine. This sweep asks the GCS directly: a group of this job whose
    creating actor is dead is removed. Runs at most every `period_s` seconds of the Tune loop.
    """

    def __init__(self, period_s: float = 5.0):
        self.period_s = period_s
        self._last_s = 0.0
        self.removed = 0

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        now = time.monotonic()
        if now - self._last_s >= self.period_s:
            self._last_s = now
            self.removed += remove_orphaned_placement_groups()


def _placement_groups() -> Any:
    """This cluster's placement groups as the GCS keeps them (its protobuf records) and their type."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table_data: Any = gcs_pb2.PlacementGroupTableData  # type: ignore[attr-defined]  # generated protobuf
    raws = state._connect_and_get_accessor().get_placement_group_table()
    return table_data, [table_data.FromString(raw) for raw in raws]


def placement_group_created(creator_actor_id: str) -> bool:
    """Whether a placement group made by the actor `creator_actor_id` (hex) has all its bundles
    reserved: for a Train controller, its workers' resources are there."""
    import ray

    table_data, groups = _placement_groups()
    return any(
        ray.ActorID(info.creator_actor_id).hex() == creator_actor_id and info.state == table_data.CREATED
        for info in groups
    )


def kill_actor(actor_id: str) -> None:
    """Kills the actor `actor_id` (hex) without restarting it. `ray.kill` takes a handle, and the Train
    controller's handle lives inside `TorchTrainer.fit()`; this is the call `ray.kill` makes with it
    (ray/_private/worker.py, Ray 2.60)."""
    import ray
    from ray._private.worker import global_worker

    global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)  # type: ignore[attr-defined]


def remove_placement_groups_of(creator_actor_id: str) -> int:
    """Removes the live placement groups the actor `creator_actor_id` (hex) made, which kills the
    actors placed in them; returns how many."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    table_data, groups = _placement_groups()
    removed = 0
    for info in groups:
        if ray.ActorID(info.creator_actor_id).hex() == creator_actor_id and info.state != table_data.REMOVED:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(info.placement_group_id)))
            removed += 1
    return removed


def remove_orphaned_placement_groups() -> int:
    """Removes this job's placement groups whose creating actor is dead; returns how many."""
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    table_data, groups = _placement_groups()
    job_id = ray.get_runtime_context().get_job_id()
    removed = 0
    for info in groups:
        alive = info.state != table_data.REMOVED
        by_actor = not ray.ActorID(info.creator_actor_id).is_nil()  # driver-made groups count as "dead"
        ours = ray.JobID(info.creator_job_id).hex() == job_id
        if alive and by_actor and info.creator_actor_dead and not info.is_detached and ours:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(info.placement_group_id)))
            removed += 1
    return removed
