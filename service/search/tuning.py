"""Assembles the Ray Tune `Tuner` of a search: trainable, searcher, ASHA, stops, callbacks, concurrency.

Kept apart from `Search` so the one place that talks to Tune's configuration objects is short.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.search.prune import PruneResult
from service.search.trial import TrialSetup, run_trial

if TYPE_CHECKING:
    from service.search.driver import Search

LAUNCH_ORDER_FILE = "launch_order.txt"
_DRIVER_RESOURCES = {"CPU": 0.01}  # a trial's driver only waits on its TorchTrainer (Tune refuses 0)


def trainable(search: Search, pr: PruneResult) -> Any:
    """`run_trial` with the search's shared setup, asking Tune for a sliver of CPU per trial driver."""
    from ray import tune

    setup = TrialSetup(
        experiment=search.experiment,
        plans={c.key: c.plan.model_dump() for c in pr.candidates},
        runs_path=str(search.path / "proxy_runs"),
        steps=search.steps,
        timeout_s=search.trial_timeout_s,
    )
    return tune.with_resources(tune.with_parameters(run_trial, setup=setup), _DRIVER_RESOURCES)


def callbacks(search: Search, pr: PruneResult, stop: Any) -> list[Any]:
    from service.search.progress import ProgressBar
    from service.search.recording import TrialRecorder
    from service.search.stopping import PlacementGroupSweeper

    runs_path = str(search.path / "proxy_runs")
    made = [
        PlacementGroupSweeper(),
        stop,
        TrialRecorder(search.target, search.name, pr.candidates, search.experiment, runs_path, search.steps),
    ]
    if search.progress:
        made.append(
            ProgressBar(
                search._planned_trials(pr), len(pr.pruned), search.space.metric, search.space.direction
            )
        )
    return made


def build_tuner(search: Search, pr: PruneResult) -> Any:
    """A new Tuner, or the saved one when the search was restored (Tune keeps its state and callbacks)."""
    from ray import tune

    from service.search.driver import _trial_name, max_concurrent_trials
    from service.search.searcher import PlanSearcher
    from service.search.stopping import NoImprovementStop, asha

    if search._restored and tune.Tuner.can_restore(str(search.path)):
        return tune.Tuner.restore(str(search.path), trainable(search, pr), resume_unfinished=True)
    space = search.space
    varied = space.params.varied()
    searcher = PlanSearcher(
        [(c.key, {name: getattr(c.plan, name) for name in varied}) for c in pr.candidates],
        varied,
        search.algorithm,
        space.metric,
        space.direction,
        seed=search.seed,
        order_file=str(search.path / LAUNCH_ORDER_FILE),
    )
    stop = NoImprovementStop(space.metric, space.direction, search.patience)
    scheduler = asha(
        space.search.asha, space.metric, space.direction, search.steps, search.experiment.proxy.warmup_steps
    )
    tune_config = tune.TuneConfig(
        search_alg=searcher,
        scheduler=scheduler,
        num_samples=search._planned_trials(pr),
        max_concurrent_trials=max_concurrent_trials(
            search.experiment.proxy.num_workers, search.experiment.proxy.device
        ),
        trial_name_creator=_trial_name,
        trial_dirname_creator=_trial_name,
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
