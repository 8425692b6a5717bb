"""`SearchResult`: what a search returns, shaped like Ray Tune's `ResultGrid`.

`best` (the best plan that ran all its steps), every trial as a `TrialRecord` (`get_dataframe()` gives
the table), the pruned plans with their reasons, and the MLflow parent run id.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.search.prune import PrunedPlan
from service.spec.plan import Plan
from service.spec.record import MEASURED, PREDICTED, Metrics

FEASIBLE = ("ok", "stopped_early")
INFEASIBLE = ("oom", "failed", "invalid", "hang")
# Never ran: the cluster did not place the trial's workers in time. Says nothing about the plan.
UNSCHEDULABLE = "unschedulable"


class TrialRecord(BaseModel):
    """One launched plan: how it ended, what was measured (last report) and what the model predicted."""

    model_config = ConfigDict(frozen=True)

    trial_id: str
    key: str
    plan: Plan
    status: str  # ok | stopped_early | oom | failed | invalid | hang | unschedulable
    reason: str = ""
    steps: int = 0
    measured: Metrics = Metrics()  # the last step's report
    predicted: Metrics = Metrics()  # the cost model's, at proxy scale
    # Why the workers ran on CPU although the experiment asked for GPUs (a GPU resource with no CUDA
    # device behind it, e.g. Ray's fake multinode provider); "" when they ran where asked. Its
    # measurements are then CPU numbers, whatever the plan says.
    device_fallback: str = ""
    mlflow_run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.model_dump(exclude={"plan"}), "plan": self.plan.model_dump()}


def trial_outcome(
    rows: list[dict[str, Any]], error: BaseException | None, steps: int
) -> tuple[str, str, int]:
    """(status, reason, last step) of a trial from its reports and Tune's error, if any."""
    stepped = [r for r in rows if _finite(r.get("step"))]
    last_step = int(stepped[-1]["step"]) if stepped else 0
    final = next((r for r in reversed(rows) if isinstance(r.get("trial_status"), str)), None)
    if final is not None:
        return str(final["trial_status"]), str(final.get("trial_reason") or ""), last_step
    if error is not None:
        from service.train.run import classify_failure

        hang = next((ln.strip() for ln in str(error).splitlines() if "hang: " in ln), None)
        if hang is not None:  # raised by the trial driver (trial.TrialHang)
            return "hang", hang[hang.index("hang: ") :], last_step
        status, reason = classify_failure(error)
        return status, reason, last_step
    # Not Tune's `done`: Tune sets it on the last result of a trial it stopped early, too.
    if stepped and (stepped[-1].get("last_step") or last_step >= steps):
        return "ok", "", last_step
    if stepped:
        return (
            "stopped_early",
            f"stopped at step {last_step} of {steps} (ASHA or the search's stop)",
            last_step,
        )
    return "failed", "the trial ended before its first report", last_step


def fallback_of(report: dict[str, Any]) -> str:
    """The worker's `device_fallback` in a report row (a string among the floats, see
    service/train/worker.py); "" when the row has none (the run ran on the device it asked for)."""
    value = report.get("device_fallback")
    return value if isinstance(value, str) else ""


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True)
class SearchResult:
    """The outcome of `Search.fit()`; frozen: nothing changes it once `fit()` has returned.

    Example (a result built by hand; `Search(...).fit()` returns one like it):
        >>> from service.spec import Plan
        >>> plans = [Plan(dp=2, micro_batch=m, precision="fp32") for m in (2, 4)]
        >>> trials = [TrialRecord(trial_id=f"t{i}", key=p.short(), plan=p, status="ok", steps=4,
        ...                       measured={"tokens_per_s": v, "peak_memory_bytes_per_rank": 2e9 / v})
        ...           for i, (p, v) in enumerate(zip(plans, (900.0, 1200.0)))]
        >>> result = SearchResult("tokens_per_s", "max", trials, [], None, "/tmp/s")
        >>> result.get_best_result().key
        'dp2-tp1-pp1-z0-mb4-ga1-rc:none'
        >>> result.get_best_result("peak_memory_bytes_per_rank", "max").key
        'dp2-tp1-pp1-z0-mb2-ga1-rc:none'
        >>> [t.trial_id for t in result.ranking]
        ['t1', 't0']
        >>> result.get_dataframe()[["trial_id", "status", "measured_tokens_per_s"]].shape
        (2, 3)
    """

    metric: str
    mode: str
    trials: Sequence[TrialRecord]  # a tuple once built
    pruned: Sequence[PrunedPlan]  # a tuple once built
    mlflow_run_id: str | None
    path: str
    tracking: Mapping[str, Any] = field(default_factory=dict)  # read-only once built
    stopped_reason: str = ""

    def __post_init__(self) -> None:
        # Own, read-only copies: the lists the caller passed in can change without changing this result,
        # and nobody can append to or overwrite what it holds (TrialRecord is frozen too).
        object.__setattr__(self, "trials", tuple(self.trials))
        object.__setattr__(self, "pruned", tuple(self.pruned))
        object.__setattr__(self, "tracking", MappingProxyType(dict(self.tracking)))

    @property
    def best(self) -> TrialRecord | None:
        """The best trial that ran every step (`ok`) by the search's metric; None when none did."""
        return self.get_best_result()

    def rank(self, metric: str | None = None, mode: str | None = None) -> list[TrialRecord]:
        """Trials that ran every step (`ok`) and measured `metric`, best first (ties keep launch order).

        Args:
            metric: a measured key (default: the search's metric), e.g. `peak_memory_bytes_per_rank`.
            mode: "max" or "min" (default: the search's mode for its own metric, else "max").
        """
        metric = metric or self.metric
        if mode is None:
            mode = self.mode if metric == self.metric else "max"
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        done = [t for t in self.trials if t.status == "ok" and metric in t.measured]
        sign = -1.0 if mode == "max" else 1.0
        return sorted(done, key=lambda t: sign * t.measured[metric])

    @property
    def ranking(self) -> list[TrialRecord]:
        """`rank()` by the search's own metric and mode: the plans that ran, best first."""
        return self.rank()

    def get_best_result(self, metric: str | None = None, mode: str | None = None) -> TrialRecord | None:
        """The best `ok` trial by `metric` and `mode` (default: the search's), as Ray Tune's
        `ResultGrid.get_best_result`; None when no trial ran every step."""
        ranked = self.rank(metric, mode)
        return ranked[0] if ranked else None

    def __len__(self) -> int:
        return len(self.trials)

    def __iter__(self) -> Iterator[TrialRecord]:
        return iter(self.trials)

    def __getitem__(self, i: int) -> TrialRecord:
        return self.trials[i]

    @property
    def num_errors(self) -> int:
        """Trials that ran and failed (oom, failed, invalid, hang)."""
        return sum(t.status in INFEASIBLE for t in self.trials)

    @property
    def num_unschedulable(self) -> int:
        """Trials whose workers the cluster never placed in time."""
        return sum(t.status == UNSCHEDULABLE for t in self.trials)

    def get_dataframe(self) -> Any:
        """All trials as a pandas table: plan fields, status, reason, measured_* and predicted_* columns."""
        import pandas as pd

        rows = []
        for t in self.trials:
            row: dict[str, Any] = {
                "trial_id": t.trial_id,
                "plan": t.key,
                "status": t.status,
                "reason": t.reason,
            }
            row.update({"steps": t.steps, **t.plan.model_dump()})
            row.update(t.measured.prefixed(MEASURED))
            row.update(t.predicted.prefixed(PREDICTED))
            row["device_fallback"] = t.device_fallback
            row["mlflow_run_id"] = t.mlflow_run_id
            rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: best, trials, pruned, mlflow_run_id (what `search --json` prints)."""
        best = self.best
        return {
            "metric": self.metric,
            "mode": self.mode,
            "best": None
            if best is None
            else {
                "plan": best.plan.model_dump(),
                "key": best.key,
                "trial_id": best.trial_id,
                "measured": best.measured.model_dump(),
                "predicted": best.predicted.model_dump(),
            },
            "trials": [t.to_dict() for t in self.trials],
            "pruned": [
                {
                    "plan": p.plan.model_dump() if p.plan else None,
                    "point": p.point,
                    "kind": p.kind,
                    "reason": p.reason,
                }
                for p in self.pruned
            ],
            "mlflow_run_id": self.mlflow_run_id,
            "path": self.path,
            "tracking": dict(self.tracking),
            "stopped_reason": self.stopped_reason,
        }
