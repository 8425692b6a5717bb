"""`PlanSearcher`: a Ray Tune `Searcher` that only ever launches candidate plans, each at most once.

- grid: the candidates in the model's order (best predicted first), so the first trials are the
  plans the planner believes in;
- random: the candidates in a seeded random order (sampling without replacement: on a finite space
  that is what random search means);
- bayes: Optuna's TPE sampler through Ray Tune's `OptunaSearch`, over the space's fields, warm-started
  with the best-predicted plans. When TPE proposes a pruned plan it is told the plan's penalty at
  once and asked again (so a pruned plan is never launched), a plan already measured is answered
  from its measurement, and after `_MAX_ASKS` proposals without a new plan the next candidate in
  model order is launched, so the search always moves.

Suggestions are `{"plan": key}`; the trainable looks the `Plan` up by key.
"""

from __future__ import annotations

import math
import pickle
import random
from typing import Any

from ray.tune.search import Searcher

from service.search.result import NO_VERDICT

_MAX_ASKS = 64


class PlanSearcher(Searcher):
    """Args:
    candidates: (key, point) pairs in model order; a point maps each searched field to its value.
    fields: every searched field with all its values (the space, pruned points included).
    algorithm: grid, random or bayes.
    metric, mode: what the trials report and its direction.
    seed: for the random order and the TPE sampler.
    warm_start: how many best-predicted plans TPE evaluates first.
    order_file: a text file to which every launch is appended as "trial_id key".
    """

    def __init__(
        self,
        candidates: list[tuple[str, dict[str, Any]]],
        fields: dict[str, list[Any]],
        algorithm: str,
        metric: str,
        mode: str,
        seed: int = 0,
        warm_start: int = 2,
        order_file: str | None = None,
    ):
        super().__init__(metric=metric, mode=mode)
        self._order_file = order_file
        self._algorithm = algorithm
        self._model_order = [key for key, _ in candidates]
        self._points = {key: point for key, point in candidates}
        self._by_point = {_point_id(point): key for key, point in candidates}
        self._order = list(self._model_order)
        if algorithm == "random":
            random.Random(seed).shuffle(self._order)
        self._launched: dict[str, str] = {}  # trial id -> plan key
        self._inner_ids: dict[str, str] = {}  # trial id -> Optuna trial id
        self._last_value: dict[str, float] = {}  # trial id -> last reported metric
        self._values: dict[str, float] = {}  # plan key -> final metric (penalty when infeasible)
        self._asks = 0
        self._inner: Any = None
        if algorithm == "bayes":
            self._inner = _optuna(fields, metric, mode, seed, [p for _, p in candidates[:warm_start]])

    # -- Tune's Searcher interface -----------------------------------------------------------------
    def suggest(self, trial_id: str) -> dict[str, Any] | None:  # or Searcher.FINISHED
        key = self._next_bayes(trial_id) if self._inner is not None else self._next_in_order()
        if key is None:
            return Searcher.FINISHED  # type: ignore[return-value]
        self._launched[trial_id] = key
        if self._order_file:  # launch order, for the result table (Tune reorders trials on restore)
            with open(self._order_file, "a") as f:
                f.write(f"{trial_id} {key}\n")
        return {"plan": key}

    def on_trial_result(self, trial_id: str, result: dict[str, Any]) -> None:
        value = result.get(self.metric)
        if isinstance(value, int | float) and math.isfinite(value):
            self._last_value[trial_id] = float(value)

    def on_trial_complete(
        self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False
    ) -> None:
        key = self._launched.get(trial_id)
        if key is None:
            return
        status = (result or {}).get("trial_status", "ok")
        if not error and status in NO_VERDICT:  # the plan did not run to a verdict: not a penalty
            inner_id = self._inner_ids.get(trial_id)
            if self._inner is not None and inner_id is not None:
                self._inner.on_trial_complete(inner_id, None, error=True)  # TPE leaves it out
            return
        ok = not error and status in ("ok", "stopped_early")
        value = self._last_value.get(trial_id) if ok else None
        self._values[key] = value if value is not None else self._penalty()
        if self._inner is None:
            return
        inner_id = self._inner_ids.get(trial_id)
        if inner_id is not None:
            self._inner.on_trial_complete(inner_id, {self.metric: self._values[key]})
        else:  # launched by the fallback: tell TPE what it measured all the same
            self._inner.add_evaluated_point(self._points[key], self._values[key])

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__.copy(), f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))

    # -- choosing ----------------------------------------------------------------------------------
    def launched_keys(self) -> list[str]:
        return list(self._launched.values())

    def _next_in_order(self) -> str | None:
        taken = set(self._launched.values())
        return next((k for k in self._order if k not in taken), None)

    def _next_bayes(self, trial_id: str) -> str | None:
        taken = set(self._launched.values())
        if len(taken) >= len(self._model_order):
            return None
        for _ in range(_MAX_ASKS):
            self._asks += 1
            inner_id = f"{trial_id}-ask{self._asks}"
            point = self._inner.suggest(inner_id)
            key = self._by_point.get(_point_id(point))
            if key is not None and key not in taken:
                self._inner_ids[trial_id] = inner_id
                return key
            # Pruned (no key) or already launched: answer at once so TPE learns, then ask again. A plan
            # still running has no value yet: a failed Optuna trial, which TPE leaves out.
            if key is not None and key not in self._values:
                self._inner.on_trial_complete(inner_id, None, error=True)
            else:
                value = self._values[key] if key is not None else self._penalty()
                self._inner.on_trial_complete(inner_id, {self.metric: value})
        return self._next_in_order()

    def _penalty(self) -> float:
        """What an infeasible or pruned plan scores: worse than anything measured."""
        if self.mode == "max":
            return 0.0
        worst = max(self._values.values(), default=1.0)
        return 10.0 * abs(worst) + 1.0


def _point_id(point: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(point.items()))


def _optuna(
    fields: dict[str, list[Any]], metric: str, mode: str, seed: int, warm: list[dict[str, Any]]
) -> Any:
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space: dict[str, Any] = {n: optuna.distributions.CategoricalDistribution(v) for n, v in fields.items()}
    return OptunaSearch(space=space, metric=metric, mode=mode, seed=seed, points_to_evaluate=warm or None)
