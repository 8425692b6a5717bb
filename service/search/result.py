"""`SearchResult`: what a search returns, shaped like Ray Tune's `ResultGrid`.

`best` (the best plan that ran all its steps), every trial as a `TrialRecord` (`get_dataframe()` gives
the table), the pruned plans with their reasons, and the MLflow parent run id. As in Tune, a trial has
`metrics`, `config`, `path`, `checkpoint` and `error`, and the grid has `errors`, `num_errors` and
`experiment_path`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict

from service.search.prune import PrunedPlan
from service.spec.errors import SpecError
from service.spec.plan import Plan
from service.spec.record import MEASURED, PREDICTED, Metrics

FEASIBLE = ("ok", "stopped_early")
INFEASIBLE = ("oom", "failed", "invalid", "hang")
# Never ran: the cluster did not place the trial's workers in time. Says nothing about the plan.
UNSCHEDULABLE = "unschedulable"
# A worker process died without an error of its own (a signal, a crash, a node lost): the trial failed,
# but says nothing about whether the plan fits (service.train.proxy_trial.classify_failure).
KILLED = "killed"
# Trials whose end says nothing about their plan: a lost worker or node (killed), a cluster that never
# placed the workers (unschedulable). They neither use up the patience nor teach the searcher a value.
# The search's driver was stopped (Ctrl-C, SIGINT) while the trial ran: `--resume` runs it again.
INTERRUPTED = "interrupted"
NO_VERDICT = (KILLED, UNSCHEDULABLE, INTERRUPTED)
ERRORS = (*INFEASIBLE, KILLED)  # trials that ran and failed: `num_errors`, `errors`


class TrialError(RuntimeError):
    """A trial's `error` (as Tune's `Result.error`): how it ended (`status`) and why (`reason`)."""

    def __init__(self, trial_id: str, status: str, reason: str):
        self.trial_id, self.status, self.reason = trial_id, status, reason
        super().__init__(f"trial {trial_id}: {status}" + (f": {reason}" if reason else ""))


class TrialRecord(BaseModel):
    """One launched plan: how it ended, what was measured (last report) and what the model predicted."""

    model_config = ConfigDict(frozen=True)

    trial_id: str
    key: str
    plan: Plan
    status: str  # ok | stopped_early | oom | killed | failed | invalid | hang | unschedulable | interrupted
    reason: str = ""
    steps: int = 0
    measured: Metrics = Metrics()  # the last step's report
    predicted: Metrics = Metrics()  # the cost model's, at proxy scale
    # Why the workers ran on CPU although the experiment asked for GPUs (a GPU resource with no CUDA
    # device behind it, e.g. Ray's fake multinode provider); "" when they ran where asked. Its
    # measurements are then CPU numbers, whatever the plan says.
    device_fallback: str = ""
    mlflow_run_id: str | None = None
    path: str = ""  # the trial's folder (Tune's trial directory), "" when not known
    checkpoint_path: str | None = None  # the trial's last Train checkpoint folder, if it saved one

    def to_dict(self) -> dict[str, Any]:
        return {**self.model_dump(exclude={"plan"}), "plan": self.plan.model_dump()}

    # -- shaped like Ray Tune's `Result` ------------------------------------------------------------
    @property
    def metrics(self) -> dict[str, Any]:
        """The last report, as Tune's `Result.metrics`: the measured quantities, the last step, and
        how the trial ended (`trial_status`, `trial_reason`)."""
        return {**self.measured.as_dict(), "step": self.steps, "trial_status": self.status,
                "trial_reason": self.reason}  # fmt: skip

    @property
    def config(self) -> dict[str, Any]:
        """What the trial ran, as Tune's `Result.config`: `{"plan": key}` (Tune's own) and the plan's
        fields."""
        return {"plan": self.key, **self.plan.model_dump()}

    @property
    def checkpoint(self) -> Any:
        """The last Train checkpoint (a `ray.train.Checkpoint`), as Tune's `Result.checkpoint`; None
        when the trial saved none (search trials save none unless asked)."""
        if not self.checkpoint_path:
            return None
        from ray.train import Checkpoint

        return Checkpoint.from_directory(self.checkpoint_path)

    @property
    def error(self) -> TrialError | None:
        """Why the trial did not run every step (a `TrialError`), as Tune's `Result.error`; None for a
        trial that ran every step or that the search stopped early."""
        if self.status in FEASIBLE:
            return None
        return TrialError(self.trial_id, self.status, self.reason)

    def __repr__(self) -> str:
        value = next(iter(self.measured.as_dict().items()), None)
        shown = f", {value[0]}={value[1]:.4g}" if value else ""
        reason = f", reason={self.reason[:60]!r}" if self.status not in FEASIBLE and self.reason else ""
        return f"TrialRecord({self.trial_id!r}, {self.key!r}, {self.status}{shown}{reason})"

    __str__ = __repr__


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
        from service.train.proxy_trial import classify_failure

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
    copied_to: str | None = None  # the search folder's copy at $SERVICE_STORAGE_PATH when that is a URI

    def __post_init__(self) -> None:
        # Own, read-only copies: the lists the caller passed in can change without changing this result,
        # and nobody can append to or overwrite what it holds (TrialRecord is frozen too).
        object.__setattr__(self, "trials", tuple(self.trials))
        object.__setattr__(self, "pruned", tuple(self.pruned))
        object.__setattr__(self, "tracking", MappingProxyType(dict(self.tracking)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Picklable (a result handed from a driver process to another, as Tune's ResultGrid is): the
        # read-only mapping proxy is not, so the fields go by value and are wrapped again on load.
        fields = (self.metric, self.mode, self.trials, self.pruned, self.mlflow_run_id, self.path)
        return type(self), (*fields, dict(self.tracking), self.stopped_reason, self.copied_to)

    @property
    def interrupted(self) -> bool:
        """Whether the search's driver was stopped before the search ended (see `INTERRUPTED`)."""
        return any(t.status == INTERRUPTED for t in self.trials)

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
        metric = self._known_metric(metric or self.metric)
        if mode is None:
            mode = self.mode if metric == self.metric else "max"
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        done = [t for t in self.trials if t.status == "ok" and metric in t.measured]
        sign = -1.0 if mode == "max" else 1.0
        return sorted(done, key=lambda t: sign * t.measured[metric])

    def metric_names(self) -> list[str]:
        """The metrics a trial can be ranked by: every quantity a worker reports, and any other one a
        trial of this search measured."""
        names = [n for n in Metrics.model_fields if n != "fits"]  # `fits` is the model's, not measured
        for t in self.trials:
            names += [k for k in t.measured.as_dict() if k not in names]
        return names

    def _known_metric(self, metric: str) -> str:
        """`metric` as a measured quantity (a report's `measured_x` is `x`); a `SpecError` (a
        ValueError) naming it and the allowed ones when no trial can have measured it, as Ray Tune
        raises for a metric its results do not have."""
        allowed = self.metric_names()
        if metric in allowed:
            return metric
        plain = metric.removeprefix(MEASURED)
        if plain in allowed:
            return plain
        raise SpecError("metric", f"unknown metric {metric!r}; allowed: {', '.join(allowed)}")

    @property
    def ranking(self) -> list[TrialRecord]:
        """`rank()` by the search's own metric and mode: the plans that ran, best first."""
        return self.rank()

    def get_best_result(self, metric: str | None = None, mode: str | None = None) -> TrialRecord | None:
        """The best `ok` trial by `metric` and `mode` (default: the search's), as Ray Tune's
        `ResultGrid.get_best_result`; None when no trial ran every step and measured it. A metric no
        trial can measure raises a `SpecError` (a ValueError) that names the allowed ones."""
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
        """Trials that ran and failed (oom, killed, failed, invalid, hang)."""
        return sum(t.status in ERRORS for t in self.trials)

    @property
    def errors(self) -> list[TrialError]:
        """The errors of the trials that ran and failed, in launch order (as Tune's
        `ResultGrid.errors`; `num_errors` counts them). Unschedulable trials never ran: see
        `num_unschedulable`, or each trial's `error`."""
        return [TrialError(t.trial_id, t.status, t.reason) for t in self.trials if t.status in ERRORS]

    @property
    def experiment_path(self) -> str:
        """The search's folder, as Tune's `ResultGrid.experiment_path` (the same as `path`)."""
        return self.path

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for t in self.trials:
            counts[t.status] = counts.get(t.status, 0) + 1
        statuses = ", ".join(f"{n} {s}" for s, n in counts.items())
        best = self.best
        shown = "none" if best is None else f"{best.key} ({self.metric}={best.measured[self.metric]:.4g})"
        return (
            f"SearchResult({len(self.trials)} trials{f' ({statuses})' if statuses else ''}, "
            f"{len(self.pruned)} pruned, best={shown})"
        )

    __str__ = __repr__

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
            "copied_to": self.copied_to,
        }
