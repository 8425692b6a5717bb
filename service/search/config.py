"""Config objects for `Search`, shaped like Ray Tune's `TuneConfig` / `RunConfig`.

`SearchConfig` says how the search runs (algorithm, trial budget, stopping, steps per trial);
`RunConfig` says where it is kept and what it shows. Both are optional: a setting left `None` falls
back to the space's `search` section, then to the experiment's proxy settings. `Search(...)` takes
settings only this way (`config=`, `run_config=`), as Ray Tune's `Tuner` does.

Example:
    >>> from service.search.config import RunConfig, SearchConfig
    >>> config = SearchConfig(algorithm="bayes", max_trials=8, patience=3)
    >>> config.algorithm, config.guided
    ('bayes', True)
    >>> RunConfig(storage_path="/tmp/searches", name="tiny").name
    'tiny'
    >>> SearchConfig(max_trials=0)
    Traceback (most recent call last):
    ...
    service.spec.errors.SpecError: max_trials: must be positive, got 0
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from service.search.space import Algorithm
from service.spec.errors import SpecError


@dataclass(frozen=True)
class SearchConfig:
    """How a search runs.

    Args:
        algorithm: grid (the cost model's order), random, or bayes (Optuna TPE); None: the space's.
        max_trials: most trials to launch; None: the space's, else every candidate.
        patience: stop after this many ended trials without a new best; None: the space's.
        steps: optimizer steps per trial; None: the space's, else the experiment's proxy.steps.
        trial_timeout_s: a trial running longer (once its workers are placed) is recorded as a hang;
            None: the space's.
        pending_timeout_s: a trial whose workers are not placed this long after it started is recorded
            as unschedulable and the search goes on; None: the space's (default 600 s).
        seed: seed of the random order and the TPE sampler; None: the space's.
        guided: prune predicted-OOM plans and launch in predicted order (False: the plain grid
            baseline that launches every valid plan in the space's order).
    """

    algorithm: str | None = None
    max_trials: int | None = None
    patience: int | None = None
    steps: int | None = None
    trial_timeout_s: float | None = None
    pending_timeout_s: float | None = None
    seed: int | None = None
    guided: bool = True

    def __post_init__(self) -> None:
        if self.algorithm is not None and self.algorithm not in get_args(Algorithm):
            raise SpecError(
                "algorithm", f"unknown algorithm {self.algorithm!r}; allowed: grid, random, bayes"
            )
        for name in ("max_trials", "steps", "trial_timeout_s", "pending_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise SpecError(name, f"must be positive, got {value}")
        if self.patience is not None and self.patience < 0:
            raise SpecError("patience", f"must be 0 (off) or positive, got {self.patience}")


@dataclass(frozen=True)
class RunConfig:
    """Where a search is kept and what it shows.

    Args:
        storage_path: folder holding searches (default: $SERVICE_SEARCH_DIR, else
            `<repo>/ray_results/search`); the search's own folder is `storage_path/name`.
        name: the search's folder and MLflow parent-run name (default: experiment-space-algorithm-time).
        progress: show a progress bar on stderr.
    """

    storage_path: str | Path | None = None
    name: str | None = None
    progress: bool = False
