"""Assembles the Ray Tune `Tuner` of a search: trainable, searcher, ASHA, stops, callbacks, concurrency.

Kept apart from `Search` so the one place that talks to Tune's configuration objects is short. It
takes a `TunerSettings` record, not the `Search` itself: this module reads nothing of the driver's
(no import of `service.search.driver`, no private state).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.search.prune import PruneResult
from service.search.space import SearchSpace
from service.search.trial import TrialSetup, run_trial
from service.spec.experiment import ExperimentSpec
from service.spec.record import report_key
from service.tracking.uri import TrackingTarget

LAUNCH_ORDER_FILE = "launch_order.txt"
# Test hook: JSON {"plan": key, "step": K, "seconds": S} in this variable, read when the Tuner is built,
# makes every worker of that plan's trial sleep S seconds before step K, so a test can act (kill the
# driver) while that trial is known to be at step K. A restored search builds its trainable afresh
# and so stalls only if the variable is set again.
STALL_ENV = "SERVICE_TEST_STALL_TRIAL"
# Test hook: JSON {"plan": key, "resources": {"unobtainium": 1}} adds those resources to each worker of
# that plan's trial, so a test can have one trial ask for what the cluster never has (unschedulable).
RESOURCES_ENV = "SERVICE_TEST_TRIAL_RESOURCES"
_DRIVER_RESOURCES = {"CPU": 0.01}  # a trial's driver only waits on its TorchTrainer (Tune refuses 0)


@dataclass(frozen=True)
class TunerSettings:
    """What the Tuner of one search is built from (the `Search` driver fills it in)."""

    experiment: ExperimentSpec
    space: SearchSpace
    name: str  # the search's folder name under storage_path, and its MLflow run name
    storage_path: Path
    target: TrackingTarget
    algorithm: str
    steps: int
    trial_timeout_s: float
    pending_timeout_s: float
    seed: int
    patience: int | None
    planned_trials: int
    progress: bool
    restored: bool

    @property
    def path(self) -> Path:
        return self.storage_path / self.name


def trial_name(trial: Any) -> str:
    return str(trial.trial_id)


def max_concurrent_trials(world_size: int, device: str) -> int:
    """Trials that fit side by side: GPUs (cuda) or CPUs (cpu, one kept for drivers) ÷ world size, at the
    cluster's full scale-out (service/cluster/capacity.py): GPU nodes that the autoscaler adds from
    zero count, and a trial that can never fit is refused in one line."""
    from service.cluster.capacity import max_concurrent_trials as at_full_scale

    return at_full_scale(world_size, device)


def trainable(search: TunerSettings, pr: PruneResult) -> Any:
    """`run_trial` with the search's shared setup, asking Tune for a sliver of CPU per trial driver."""
    from ray import tune

    setup = TrialSetup(
        experiment=search.experiment,
        plans={c.key: c.plan.model_dump() for c in pr.candidates},
        runs_path=str(search.path / "proxy_runs"),
        steps=search.steps,
        timeout_s=search.trial_timeout_s,
        pending_timeout_s=search.pending_timeout_s,
        stall=json.loads(os.environ[STALL_ENV]) if os.environ.get(STALL_ENV) else None,
        extra_resources=json.loads(os.environ[RESOURCES_ENV]) if os.environ.get(RESOURCES_ENV) else None,
    )
    return tune.with_resources(tune.with_parameters(run_trial, setup=setup), _DRIVER_RESOURCES)


def callbacks(search: TunerSettings, pr: PruneResult, stop: Any) -> list[Any]:
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    from service.search.progress import ProgressBar
    from service.search.recording import TrialRecorder
    from service.search.stopping import PlacementGroupSweeper

    runs_path = str(search.path / "proxy_runs")
    made = [
        # What `Result.metrics_dataframe` reads back (service/search/collect.py); Tune's third default
        # logger, TensorBoard's, is left out (the driver sets TUNE_DISABLE_AUTO_CALLBACK_LOGGERS): the
        # records are in MLflow, and importing tensorboardX costs the driver ~2.5 s (cProfile here).
        CSVLoggerCallback(),
        JsonLoggerCallback(),
        PlacementGroupSweeper(),
        stop,
        TrialRecorder(search.target, search.name, pr.candidates, search.experiment, runs_path, search.steps),
    ]
    if search.progress:
        made.append(
            ProgressBar(
                search.planned_trials, len(pr.pruned), report_key(search.space.metric), search.space.direction
            )
        )
    return made


def build_tuner(search: TunerSettings, pr: PruneResult) -> Any:
    """A new Tuner, or the saved one when the search was restored (Tune keeps its state and callbacks)."""
    from ray import tune

    from service.search.searcher import PlanSearcher
    from service.search.stopping import NoImprovementStop, asha

    if search.restored and tune.Tuner.can_restore(str(search.path)):
        return tune.Tuner.restore(str(search.path), trainable(search, pr), resume_unfinished=True)
    space = search.space
    metric = report_key(space.metric)  # Tune reads the metric under its name in the workers' reports
    varied = space.params.varied()
    searcher = PlanSearcher(
        [(c.key, {name: getattr(c.plan, name) for name in varied}) for c in pr.candidates],
        varied,
        search.algorithm,
        metric,
        space.direction,
        seed=search.seed,
        order_file=str(search.path / LAUNCH_ORDER_FILE),
    )
    stop = NoImprovementStop(metric, space.direction, search.patience)
    scheduler = asha(
        space.search.asha, metric, space.direction, search.steps, search.experiment.proxy.warmup_steps
    )
    tune_config = tune.TuneConfig(
        search_alg=searcher,
        scheduler=scheduler,
        num_samples=search.planned_trials,
        max_concurrent_trials=max_concurrent_trials(
            search.experiment.proxy.num_workers, search.experiment.proxy.device
        ),
        trial_name_creator=trial_name,
        trial_dirname_creator=trial_name,
        reuse_actors=False,
    )
    run_config = tune.RunConfig(
        name=search.name,
        storage_path=str(search.storage_path),
        stop=stop,
        callbacks=callbacks(search, pr, stop),
        failure_config=tune.FailureConfig(max_failures=0),
        log_to_file=True,
        verbose=0,
    )
    return tune.Tuner(trainable(search, pr), param_space={}, tune_config=tune_config, run_config=run_config)
