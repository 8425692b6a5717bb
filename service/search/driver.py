"""`Search`: Ray Tune searches plans at proxy scale, pruned and ordered by the cost model, recorded in MLflow.

Shaped like Ray's `Tuner`: construct, `fit()`, get a result; `Search.restore(path)` continues a search
whose driver was killed (finished trials are not run again; the trial that was running resumes from
its Train checkpoint, since its Train run is named after the trial id).

Example:
    >>> from service.search import Search
    >>> from service.search import SearchConfig
    >>> result = Search("experiments/tiny-cpu.yaml", "search_spaces/tiny-cpu.yaml",
    ...                 config=SearchConfig(algorithm="grid", max_trials=4)).fit()    # doctest: +SKIP
    >>> result.best.plan, result.mlflow_run_id                                         # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

from service.cluster.storage import publish, results_root
from service.search.collect import collect_trials
from service.search.config import RunConfig, SearchConfig
from service.search.prune import PruneResult, prune_space, pruning_from_json, pruning_to_json
from service.search.result import SearchResult
from service.search.space import Algorithm, SearchSpace, load_space, space_from_dict
from service.search.state import STATE_FILE, invalid_state, read_state, tune_state_problem
from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.record import PREDICTED
from service.tracking.uri import TrackingTarget, repo_root, resolve
from service.train.ray_session import ensure_ray

RESULTS_ENV = "SERVICE_SEARCH_DIR"  # where searches are kept when no storage_path is given
FORCE_TRIAL_CLEANUP_S = 30


@contextmanager
def _env(**values: str) -> Any:
    """Sets environment variables the user has not set, for the duration of the block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def driver_cpus(world_size: int) -> int:
    """Logical CPUs of a local Ray for a search: one beyond the machine's (or the trial's world size, if
    larger) for the trial drivers, which hold 0.01 CPU each while their workers hold one CPU each."""
    return max(os.cpu_count() or 1, world_size) + 1


class Search:
    """Searches the plans of `space` for `experiment` on proxy runs.

    Settings come as two config objects, as in Ray Tune's `Tuner(tune_config=..., run_config=...)`:
    `SearchConfig` (how it runs) and `RunConfig` (where it is kept and what it shows). A setting left
    None falls back to the space's `search` section, then to the experiment's proxy settings.

    Args:
        experiment: `ExperimentSpec` or a path to its YAML.
        space: `SearchSpace`, a path to its YAML, or the same data as a dict.
        config: how the search runs (algorithm, max_trials, patience, steps, trial_timeout_s,
            pending_timeout_s, seed, guided); see `SearchConfig`.
        run_config: where it is kept and what it shows (storage_path, name, progress); see `RunConfig`.

    Example:
        >>> from service import Search, SearchSpace
        >>> from service.search import RunConfig, SearchConfig
        >>> search = Search("experiments/tiny-cpu.yaml",
        ...                 SearchSpace(params={"zero_stage": [0, 1], "micro_batch": [2, 4]}),
        ...                 config=SearchConfig(algorithm="grid", max_trials=2, steps=4),
        ...                 run_config=RunConfig(storage_path="/tmp/searches"))
        >>> result = search.fit()                                                     # doctest: +SKIP
        >>> best = result.get_best_result("tokens_per_s", "max")                      # doctest: +SKIP
    """

    def __init__(
        self,
        experiment: ExperimentSpec | str | Path,
        space: SearchSpace | str | Path | dict[str, Any],
        *,
        config: SearchConfig | None = None,
        run_config: RunConfig | None = None,
    ):
        self.experiment = (
            experiment if isinstance(experiment, ExperimentSpec) else load_experiment(experiment)
        )
        if isinstance(space, SearchSpace):
            self.space = space
        else:
            self.space = load_space(space) if isinstance(space, str | Path) else space_from_dict(space)
        written_for = self.space.experiment
        if written_for is not None and written_for != self.experiment.name:
            raise SpecError(
                "experiment",
                f"the search space {self.space.name!r} was written for experiment {written_for!r}, not "
                f"{self.experiment.name!r} (its plan values assume that model and cluster)",
            )
        self.config = config or SearchConfig()
        run = run_config or RunConfig()
        settings = self.space.search
        self.algorithm = self.config.algorithm or settings.algorithm
        if self.algorithm not in get_args(Algorithm):
            raise SpecError(
                "algorithm", f"unknown algorithm {self.algorithm!r}; allowed: grid, random, bayes"
            )
        self.max_trials = self.config.max_trials or settings.max_trials
        self.patience = settings.patience if self.config.patience is None else self.config.patience
        self.steps = self.config.steps or settings.steps or self.experiment.proxy.steps
        self.trial_timeout_s = self.config.trial_timeout_s or settings.trial_timeout_s
        self.pending_timeout_s = self.config.pending_timeout_s or settings.pending_timeout_s
        self.seed = settings.seed if self.config.seed is None else self.config.seed
        self.guided = self.config.guided
        self.progress = run.progress
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.name = run.name or f"{self.experiment.name}-{self.space.name}-{self.algorithm}-{stamp}"
        # Kept where the cluster's storage is when nobody named a folder: a remote one gets a copy at the end.
        self._publish = run.storage_path is None and not os.environ.get(RESULTS_ENV)
        default_storage = os.environ.get(RESULTS_ENV) or results_root(repo_root() / "ray_results") / "search"
        self.storage_path = Path(run.storage_path or default_storage).resolve()
        self.target: TrackingTarget = resolve(self.experiment.tracking, self.experiment.name)
        self._pruning: PruneResult | None = None
        self._restored = False

    @property
    def path(self) -> Path:
        """The search's folder: pass it to `Search.restore` (or `search --resume`)."""
        return self.storage_path / self.name

    # -- persistence -------------------------------------------------------------------------------
    _SETTINGS = (
        "algorithm", "max_trials", "patience", "steps", "trial_timeout_s", "pending_timeout_s", "seed",
        "guided",
    )  # fmt: skip

    def _state(self) -> dict[str, Any]:
        """Everything `restore` needs, as JSON: specs, settings, store, and the pruning it decided."""
        t = self.target
        return {
            "experiment": self.experiment.model_dump(mode="json"),
            "space": self.space.model_dump(mode="json"),
            "settings": {name: getattr(self, name) for name in self._SETTINGS},
            "tracking": {"uri": t.uri, "experiment_name": t.experiment_name,
                         "artifact_location": t.artifact_location, "buffer_dir": str(t.buffer_dir)},
            "pruning": pruning_to_json(self.pruning()),
        }  # fmt: skip

    @classmethod
    def can_restore(cls, path: str | Path) -> bool:
        return (Path(path) / STATE_FILE).is_file() and tune_state_problem(Path(path)) is None

    @classmethod
    def restore(cls, path: str | Path, progress: bool = False) -> Search:
        """The search saved at `path` (its folder), ready for `fit()` to continue it.

        Tune restores the search's callbacks as they were saved, progress bar included; `progress`
        only matters when the driver died before its Tuner started.
        """
        folder = Path(path).resolve()
        state = read_state(folder)
        try:
            return cls._from_state(folder, state, progress)
        except (ValueError, KeyError, TypeError) as err:  # pydantic's ValidationError is a ValueError
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise invalid_state(folder, first) from None

    @classmethod
    def _from_state(cls, folder: Path, state: dict[str, Any], progress: bool) -> Search:
        search = cls(
            ExperimentSpec.model_validate(state["experiment"]),
            SearchSpace.model_validate(state["space"], context={"restored": True}),  # as it was saved
            config=SearchConfig(**state["settings"]),
            run_config=RunConfig(storage_path=folder.parent, name=folder.name, progress=progress),
        )
        search.target = TrackingTarget(
            **{**state["tracking"], "buffer_dir": Path(state["tracking"]["buffer_dir"])}
        )
        search._pruning = pruning_from_json(state["pruning"])
        search._restored = True
        return search

    def pruning(self) -> PruneResult:
        """Candidates in launch order and pruned plans (computed once; a restored search keeps its own)."""
        if self._pruning is None:
            self._pruning = prune_space(self.experiment, self.space, guided=self.guided)
        return self._pruning

    # -- running -----------------------------------------------------------------------------------
    def fit(self) -> SearchResult:
        """Runs (or continues) the search; returns every trial, the pruned plans and the best plan.

        One driver per search folder: while another process runs this search (or another one in the
        same folder), this raises `FolderLocked` (a `SpecError`) naming the folder and that process.
        """
        from service.search.lock import folder_lock

        with folder_lock(self.path, "search"):
            return self._fit()

    def _fit(self) -> SearchResult:
        from service.search import recording

        pr = self.pruning()
        if not self._restored and (self.path / STATE_FILE).exists():
            # A second search under one name would write over the first one's state and Tune's, and record
            # its trials under the first one's MLflow run (same key), contradicting its counts.
            raise SpecError(
                "name",
                f"a search named {self.name!r} is already in {self.path}: continue it with "
                "`Search.restore(path)` (`search --resume PATH`), or give another name",
            )
        if not self._restored:
            (self.path / STATE_FILE).write_text(json.dumps(self._state(), indent=1))
        recording.start_search(self.target, self.name, self._run_info(pr), self._documents())
        if not self._restored:
            recording.record_pruned(self.target, self.name, pr.pruned)
        if not pr.candidates:
            return self._all_pruned(pr)
        started = ensure_ray(driver_cpus(self.experiment.proxy.num_workers))
        try:
            # A trial Tune stops (ASHA, a hang, an error) and whose actor does not exit gracefully is
            # killed after TUNE_FORCE_TRIAL_CLEANUP_S: Tune's 600 s would hold its workers' resources
            # and keep the next trial pending that long.
            # Silent on stdout, as a library call should be: with the new output engine even
            # `verbose=0` prints Tune's configuration box and a TensorBoard hint (its reporter's
            # `experiment_started` ignores the verbosity, Ray 2.60); the legacy engine at verbosity 0
            # prints nothing. The progress bar, when asked for, is ours (on stderr).
            # A new search names its loggers itself (tuning.callbacks); a restored one keeps the callbacks
            # it was saved with, and Tune's defaults complete them as they did when it was made.
            loggers = {} if self._restored else {"TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1"}
            with _env(
                **loggers,
                RAY_AIR_NEW_OUTPUT="0",
                TUNE_DISABLE_STRICT_METRIC_CHECKING="1",
                TUNE_GLOBAL_CHECKPOINT_S="2",
                TUNE_FORCE_TRIAL_CLEANUP_S=str(FORCE_TRIAL_CLEANUP_S),
            ):
                grid = self._tuner(pr).fit()
        finally:
            if started:
                import ray

                ray.shutdown()
        result = self._collect(grid, pr)
        recording.finish_search(self.target, self.name, result)
        result = self._with_tracking(result)
        copied = publish(self.path, "search", self.name) if self._publish else None
        return dataclasses.replace(result, copied_to=copied) if copied else result

    def _planned_trials(self, pr: PruneResult) -> int:
        return min(self.max_trials or len(pr.candidates), len(pr.candidates))

    def _tuner(self, pr: PruneResult) -> Any:
        from service.search.tuning import TunerSettings, build_tuner

        settings = TunerSettings(
            experiment=self.experiment,
            space=self.space,
            name=self.name,
            storage_path=self.storage_path,
            target=self.target,
            algorithm=self.algorithm,
            steps=self.steps,
            trial_timeout_s=self.trial_timeout_s,
            pending_timeout_s=self.pending_timeout_s,
            seed=self.seed,
            patience=self.patience,
            planned_trials=self._planned_trials(pr),
            progress=self.progress,
            restored=self._restored,
        )
        return build_tuner(settings, pr)

    def _run_info(self, pr: PruneResult) -> dict[str, Any]:
        return {
            "run_name": self.name,
            "experiment": self.experiment.name,
            "space": self.space.name,
            "algorithm": self.algorithm,
            "guided": self.guided,
            "metric": self.space.metric,
            "mode": self.space.direction,
            "max_trials": self.max_trials or "all",
            "patience": self.patience or "none",
            "steps": self.steps,
            "space_size": pr.size,
            "num_candidates": len(pr.candidates),
            "num_pruned": len(pr.pruned),
            "proxy_workers": self.experiment.proxy.num_workers,
            "proxy_device": self.experiment.proxy.device,
            "path": str(self.path),
        }

    def _documents(self) -> dict[str, Any]:
        pr = self.pruning()
        return {
            "experiment.yaml": self.experiment.model_dump(mode="json"),
            "search_space.yaml": self.space.model_dump(mode="json", exclude_none=True),
            "pruned.json": [{"plan": p.label, "kind": p.kind, "reason": p.reason} for p in pr.pruned],
            # MLflow artifact; its prediction keys keep their names (predicted_x).
            "candidates.json": [
                {"plan": c.key, "predicted": c.predicted.prefixed(PREDICTED)} for c in pr.candidates
            ],
        }

    def _all_pruned(self, pr: PruneResult) -> SearchResult:
        """Records the outcome, then says so in one line: nothing can be launched."""
        from service.search import recording

        result = SearchResult(
            self.space.metric,
            self.space.direction,
            [],
            pr.pruned,
            None,
            str(self.path),
            stopped_reason="every plan of the space was pruned",
        )
        recording.finish_search(self.target, self.name, result)
        result = self._with_tracking(result)
        kinds = sorted({p.kind for p in pr.pruned})
        first = pr.pruned[0].reason if pr.pruned else "no plans"
        where = f"; recorded in MLflow run {result.mlflow_run_id}" if result.mlflow_run_id else ""
        raise SpecError(
            "space",
            f"every one of the {len(pr.pruned)} plans is pruned ({', '.join(kinds)}; first: {first}){where}",
            self.space.name,
        )

    def _with_tracking(self, result: SearchResult) -> SearchResult:
        from service.search.recording import parent_key, trial_key
        from service.tracking.tracker import tracker_for

        tracker = tracker_for(self.target)
        if tracker.pending_count():
            tracker.connect()  # one more try, so the report says whether records still wait
        trials = [
            t.model_copy(update={"mlflow_run_id": tracker.run_id(trial_key(self.name, t.trial_id))})
            for t in result.trials
        ]
        return dataclasses.replace(
            result,
            trials=trials,
            tracking=tracker.status(),
            mlflow_run_id=tracker.run_id(parent_key(self.name)),
        )

    def _collect(self, grid: Any, pr: PruneResult) -> SearchResult:
        from service.search.result import INTERRUPTED
        from service.search.state import unfinished_trials

        # Tune returns from a Ctrl-C as from a finished search; its state says which trials still ran.
        stopped = unfinished_trials(self.path)
        again = f"`python -m service search --resume {self.path}` continues it"
        why = {"status": INTERRUPTED, "reason": f"the search was stopped as it ran; {again}"}
        # One still waiting for its workers never started (no MLflow run): like a plan not yet launched,
        # it is left out; `--resume` runs it.
        trials = [
            t.model_copy(update=why) if t.trial_id in stopped else t
            for t in collect_trials(grid, pr, self.steps, self.path)
            if stopped.get(t.trial_id) != "PENDING"
        ]
        reason = f"interrupted: {again}" if stopped else self._stopped_reason(len(trials), pr)
        return SearchResult(
            self.space.metric,
            self.space.direction,
            trials,
            pr.pruned,
            None,
            str(self.path),
            stopped_reason=reason,
        )

    def _stopped_reason(self, ran: int, pr: PruneResult) -> str:
        planned = self._planned_trials(pr)
        if ran >= planned:
            return f"all {planned} planned trials ran"
        if self.patience:
            return f"no improvement in the last {self.patience} trials"
        return f"{ran} of {planned} trials ran"
