"""Runs the chosen proxy plans through the project's Ray Tune `Search` (MLflow parent and child runs,
hang and failure handling, resume), launching exactly the chosen plans in the chosen order.

`PlannedSearch` is a `Search` whose candidates are given instead of derived from a space: it overrides
`pruning()`, the one hook `Search` reads its candidates from. The space it carries only describes
the chosen plans' values (for the MLflow record); ASHA and patience are off, since every proxy is a
measurement the calibration needs in full. A run killed mid-way is continued with `Search.restore`
(its saved state holds these same candidates), so finished proxy trials are not run again.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from service.design.validate import Choice
from service.search.config import RunConfig, SearchConfig
from service.search.driver import STATE_FILE, Search
from service.search.prune import Candidate, PruneResult, proxy_prediction
from service.search.result import SearchResult
from service.search.space import space_from_dict
from service.spec.experiment import ExperimentSpec
from service.spec.record import Metrics

SPACE_FIELDS = (
    "zero_stage",
    "offload_optimizer",
    "offload_params",
    "tp",
    "pp",
    "micro_batch",
    "grad_accum",
    "recompute",
)
TRIAL_TIMEOUT_S = 600.0


class PlannedSearch(Search):
    """A `Search` over an explicit list of proxy plans, launched in order."""

    def __init__(self, experiment: ExperimentSpec, choices: list[Choice], **kwargs: Any):
        values: dict[str, list[Any]] = {f: [] for f in SPACE_FIELDS}
        for c in choices:
            for f in SPACE_FIELDS:
                v = getattr(c.proxy_plan, f)
                if v not in values[f]:
                    values[f].append(v)
        space = space_from_dict(
            {
                "name": "run-proxies",
                "description": "the plans `run` chose to validate: " + ", ".join(c.reason for c in choices),
                "params": values,
                "search": {
                    "algorithm": "grid",
                    "max_trials": max(1, len(choices)),
                    "asha": None,
                    "trial_timeout_s": TRIAL_TIMEOUT_S,
                },
            }
        )
        super().__init__(experiment, space, **kwargs)
        self._choices = choices
        self._planned: PruneResult | None = None

    def pruning(self) -> PruneResult:
        if self._planned is None:
            candidates = []
            for c in self._choices:
                try:
                    predicted = proxy_prediction(self.experiment, c.proxy_plan)
                except Exception:  # the measurement still has value without the model's side
                    predicted = Metrics()
                value = predicted.get("tokens_per_s", math.nan)
                candidates.append(Candidate(c.proxy_plan.short(), c.proxy_plan, predicted, value, c.reason))
            self._planned = PruneResult(candidates, [])
        return self._planned


def saved_search(folder: Path, experiment: ExperimentSpec, choices: list[Choice]) -> Path | None:
    """The search a killed (or finished) run left in `folder` for the same proxy experiment and the same
    chosen plans, if any; a search made for another experiment or another choice is not continued."""
    wanted_experiment = experiment.model_dump(mode="json")
    wanted = [c.proxy_plan.short() for c in choices]
    found = sorted(folder.glob(f"*/{STATE_FILE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for state_file in found:
        if not Search.can_restore(state_file.parent):  # Tune's state cut off by the kill: start afresh
            continue
        try:
            state = json.loads(state_file.read_text())
            keys = [c["key"] for c in state["pruning"]["candidates"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if state.get("experiment") == wanted_experiment and keys == wanted:
            return state_file.parent
    return None


def run_proxies(
    experiment: ExperimentSpec, choices: list[Choice], folder: Path, steps: int | None, progress: bool
) -> tuple[SearchResult, str]:
    """(the search's result, its name): continues the matching search saved in `folder`, or starts one."""
    saved = saved_search(folder, experiment, choices)
    if saved is not None:
        search: Search = Search.restore(saved, progress=progress)
    else:
        name = f"run-{experiment.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        search = PlannedSearch(
            experiment,
            choices,
            config=SearchConfig(steps=steps),
            run_config=RunConfig(storage_path=folder, name=name, progress=progress),
        )
    return search.fit(), search.name
