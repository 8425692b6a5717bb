"""A tqdm progress bar for a search: trials done / planned, best so far, pruned count (on stderr)."""

from __future__ import annotations

import math
import sys
from typing import Any

from ray.tune import Callback

_ENDED = ("TERMINATED", "ERROR")


class ProgressBar(Callback):
    """Tune callback; the bar itself is not pickled (Tune saves callbacks with the experiment)."""

    def __init__(self, total: int, pruned: int, metric: str, mode: str):
        self.total, self.pruned, self.metric, self.mode = total, pruned, metric, mode
        self._bar: Any = None
        self._state: tuple[Any, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_bar": None}

    def _best(self, trials: list) -> float | None:
        """Best metric among trials that ran every step (their last report says ok)."""
        values = []
        for t in trials:
            last_result = getattr(t, "last_result", None) or {}
            status = last_result.get("trial_status")  # the trial's own last word (Tune's `done` is not one)
            last = (getattr(t, "metric_analysis", None) or {}).get(self.metric, {}).get("last")
            if status == "ok" and isinstance(last, int | float) and math.isfinite(last):
                values.append(float(last))
        if not values:
            return None
        return max(values) if self.mode == "max" else min(values)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        done = sum(t.status in _ENDED for t in trials)
        running = sum(t.status == "RUNNING" for t in trials)
        best = self._best(trials)
        state = (done, running, best)
        if self._bar is not None and state == self._state:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total, desc="search", unit="trial", file=sys.stderr, dynamic_ncols=True
            )
        self._state = state
        shown = f"{best:,.1f}" if best is not None else "n/a"
        self._bar.set_description(f"search (running {running}, pruned {self.pruned})", refresh=False)
        self._bar.set_postfix_str(f"best {self.metric}={shown}", refresh=False)
        self._bar.n = done
        self._bar.refresh()

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self._bar is not None:
            self.on_step_end(0, trials)
            self._bar.close()
            self._bar = None
