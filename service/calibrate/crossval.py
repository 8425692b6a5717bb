"""Leave-one-source-out cross-validation, and the prediction intervals it yields.

For each source s: fit on every other source, predict s's runs. Those out-of-sample log residuals
log(measured / predicted) are the honest error of the method on a source it has never seen.

Intervals (80 %): the source-weighted 10th and 90th percentiles of the out-of-sample log residuals
(every source weighs the same however many rows it has), around the point estimate, widened outside
the fitted domain by `ModelParams.widening` (more GPUs, longer sequences, an unseen GPU type). Their
coverage is checked the same way: the interval for a held-out source is built from the other
sources' out-of-sample residuals and the fold's domain, never from the source itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from service.calibrate.fit import fit, predict_runs
from service.calibrate.runs import MeasuredRun
from service.spec.param_bands import MEMORY_PARAMS, PUBLISHED_FIT_PARAMS
from service.spec.params import Domain, FitRun, ModelParams, Residuals, interval_bounds
from service.spec.stack import stack_names

# An 80 % interval's quantiles need residuals beyond its tails, from more than one other source per fold.
MIN_INTERVAL_RUNS = 10
MIN_INTERVAL_SOURCES = 3
METHOD = (
    "leave-one-source-out log residuals log(measured/predicted), source-weighted 10th/90th percentiles; "
    "widened by 1 + {w:g}·(doublings beyond the fitted GPU count and sequence length) + {u:g} for an "
    "unseen GPU type + {s:g} for a software stack not fit on that GPU"
)


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The q-quantile of `values` under `weights` (midpoint interpolation of the weighted CDF)."""
    order = np.argsort(values)
    v, w = np.asarray(values, float)[order], np.asarray(weights, float)[order]
    cdf = (np.cumsum(w) - 0.5 * w) / w.sum()
    return float(np.interp(q, cdf, v))


def run_stack(run: MeasuredRun) -> str:
    """The run's software stack (service/spec/stack.py), without its GPU."""
    legacy = run.workload.zero3_collectives == "per_tensor_lists"
    return str(stack_names(run.plan_table(), legacy, run.model.moe is not None)[0])


def domain_of(runs: Sequence[MeasuredRun]) -> Domain:
    return Domain(
        max_gpus=max(r.cluster.num_gpus for r in runs),
        max_seq_len=max(r.workload.seq_len for r in runs),
        gpu_types=sorted({r.cluster.gpu.name for r in runs}),
        stacks=sorted({f"{run_stack(r)} on {r.cluster.gpu.name}" for r in runs}),
    )


def offset_free_scatter(log_res: np.ndarray, sources: Sequence[str]) -> float:
    """Source-weighted RMS of the log residuals about each source's own mean: the error left once a
    source's common offset (its stack, its cluster, its way of measuring) is taken out."""
    res = np.asarray(log_res, dtype=float)
    src = np.asarray(sources)
    dev = np.zeros_like(res)
    w = np.zeros_like(res)
    for s in set(sources):
        mine = src == s
        dev[mine] = res[mine] - res[mine].mean()
        w[mine] = 1.0 / mine.sum()
    return float(np.sqrt(np.sum(w * dev**2) / w.sum()))


def residuals_summary(log_res: np.ndarray, sources: Sequence[str], prior: ModelParams) -> Residuals:
    """Source-weighted q10/q90 of out-of-sample log residuals, and their offset-free scatter."""
    counts = {s: sources.count(s) for s in set(sources)}
    w = np.array([1.0 / counts[s] for s in sources])
    return Residuals(
        n=len(log_res),
        q10=weighted_quantile(log_res, w, 0.10),
        q90=weighted_quantile(log_res, w, 0.90),
        method=METHOD.format(
            w=prior.widen_per_doubling, u=prior.widen_unseen_gpu, s=prior.widen_unseen_stack
        ),
        scatter=offset_free_scatter(log_res, sources),
    )


@dataclass(frozen=True)
class SourceScore:
    source: str
    n: int
    mape: float  # mean |predicted/measured − 1| out of sample
    bias_log: float  # mean log(predicted/measured)
    coverage: float  # share of runs inside their 80 % interval
    params: ModelParams  # the fold's fit (on every other source)


@dataclass(frozen=True)
class CrossValidation:
    """Out-of-sample errors per source and overall, and the interval coverage."""

    per_source: dict[str, SourceScore]
    predicted: dict[str, float]  # run id → out-of-sample tokens/s per GPU
    low: dict[str, float]
    high: dict[str, float]
    log_residuals: dict[str, float]  # run id → log(measured / predicted), out of sample
    sources: dict[str, str] = field(default_factory=dict)  # run id → source

    @property
    def mape(self) -> float:
        return float(np.mean([abs(np.exp(-r) - 1) for r in self.log_residuals.values()]))

    @property
    def coverage(self) -> float:
        inside = [
            self.low[k] <= self.predicted[k] * np.exp(r) <= self.high[k]
            for k, r in self.log_residuals.items()
        ]
        return float(np.mean(inside))

    def summary(self) -> dict[str, Any]:
        """What `calibrate --json` prints under `crossval`."""
        return {
            "method": "leave-one-source-out",
            "mape": self.mape,
            "coverage_80": self.coverage,
            "per_source": {
                s: {"n": v.n, "mape": v.mape, "bias_log": v.bias_log, "coverage_80": v.coverage}
                for s, v in self.per_source.items()
            },
        }

    def residuals(self, prior: ModelParams) -> Residuals:
        ids = list(self.log_residuals)
        return residuals_summary(
            np.array([self.log_residuals[i] for i in ids]), [self.sources[i] for i in ids], prior
        )


def leave_one_source_out(
    runs: Sequence[MeasuredRun], prior: ModelParams | None = None, names: Sequence[str] = PUBLISHED_FIT_PARAMS
) -> CrossValidation:
    """Fits once per source without it and scores that source; then builds each held-out source's
    intervals from the other sources' out-of-sample residuals (see the module docstring)."""
    prior = prior or ModelParams()
    runs = [r for r in runs if r.tokens_per_s_per_gpu]
    sources = sorted({r.source for r in runs})
    if len(sources) < 2:
        raise ValueError("leave-one-source-out needs runs from at least two sources")
    folds: dict[str, ModelParams] = {}
    predicted: dict[str, float] = {}
    log_res: dict[str, float] = {}
    analytical = ModelParams()
    for s in sources:
        train = [r for r in runs if r.source != s]
        test = [r for r in runs if r.source == s]
        # A prior fit on s (`--prior` the shipped set, scored on the published runs) would hand the fold
        # what s taught it through the pull towards the prior: that fold starts from the analytical values.
        start = prior.with_values({n: analytical[n] for n in names}) if s in prior.fit_on else prior
        params = fit(train, start, names, name=f"without-{s}").params
        folds[s] = params.model_copy(update={"domain": domain_of(train)})
        for r, p in zip(test, predict_runs(test, params), strict=True):
            predicted[r.id] = float(p)
            log_res[r.id] = float(np.log(r.tokens_per_s_per_gpu / p))  # type: ignore[operator]
    source_of = {r.id: r.source for r in runs}
    low: dict[str, float] = {}
    high: dict[str, float] = {}
    per_source: dict[str, SourceScore] = {}
    for s in sources:
        others = [i for i in log_res if source_of[i] != s]
        resid = residuals_summary(
            np.array([log_res[i] for i in others]), [source_of[i] for i in others], prior
        )
        fold = folds[s].model_copy(update={"residuals": resid})
        test = [r for r in runs if r.source == s]
        for r in test:
            lo, hi = interval_bounds(
                predicted[r.id],
                fold,
                r.cluster.num_gpus,
                r.workload.seq_len,
                r.cluster.gpu.name,
                [run_stack(r)],
            )
            low[r.id], high[r.id] = float(np.squeeze(lo)), float(np.squeeze(hi))
        res = np.array([log_res[r.id] for r in test])
        inside = [low[r.id] <= r.tokens_per_s_per_gpu <= high[r.id] for r in test]  # type: ignore[operator]
        per_source[s] = SourceScore(
            source=s,
            n=len(test),
            mape=float(np.mean(np.abs(np.exp(-res) - 1))),
            bias_log=float(np.mean(-res)),
            coverage=float(np.mean(inside)),
            params=folds[s],
        )
    return CrossValidation(per_source, predicted, low, high, log_res, source_of)


def fit_runs(runs: Sequence[MeasuredRun], cv: CrossValidation) -> list[FitRun]:
    """Each cross-validated run with its out-of-sample error, for `ModelParams.runs`."""
    return [
        FitRun(
            id=r.id,
            source=r.source,
            model=r.model.name,
            params_b=r.model.num_params / 1e9,
            gpu=r.cluster.gpu.name,
            num_gpus=r.cluster.num_gpus,
            stack=run_stack(r),
            plan=r.plan.short(),
            error=float(np.expm1(-cv.log_residuals[r.id])),
        )
        for r in runs
        if r.id in cv.log_residuals
    ]


def calibrate(
    runs: Sequence[MeasuredRun],
    prior: ModelParams | None = None,
    names: Sequence[str] = PUBLISHED_FIT_PARAMS,
    name: str = "fitted",
    note: str = "",
    crossval: bool = True,
) -> tuple[ModelParams, CrossValidation | None]:
    """The full procedure: cross-validate, then fit on every run; the shipped set carries the
    cross-validated residuals (its intervals) and the domain of all runs.

    Without cross-validation (`crossval=False`, or runs from a single source: nothing to leave out) it
    is the fit alone; the second item is None. A fit that moved time parameters then has no residuals
    (its estimates carry no interval) and no scored runs: the prior's were measured on other values."""
    prior = prior or ModelParams()
    used = [r for r in runs if r.tokens_per_s_per_gpu]
    if not crossval or len({r.source for r in used}) < 2:
        params = fit(runs, prior, names, name=name).params
        update: dict[str, Any] = {"domain": domain_of(used or runs), "note": note}
        if any(n not in MEMORY_PARAMS for n in names):
            update.update(residuals=Residuals(), runs=[])
        return params.model_copy(update=update), None
    cv = leave_one_source_out(runs, prior, names)
    final = fit(runs, prior, names, name=name).params
    params = final.model_copy(
        update={
            "residuals": cv.residuals(prior) if interval_withheld(cv) is None else Residuals(),
            "domain": domain_of(used),
            "runs": fit_runs(used, cv),
            "note": note,
            "version": prior.version,
        }
    )
    return params, cv


def interval_withheld(cv: CrossValidation) -> str | None:
    """Why `cv`'s residuals are too few for an 80 % interval (None when they suffice). The 10th and 90th
    percentiles of a handful of residuals are their extremes: two runs gave a "-2 %/+0 %" band."""
    runs, sources = len(cv.log_residuals), len(cv.per_source)
    if runs >= MIN_INTERVAL_RUNS and sources >= MIN_INTERVAL_SOURCES:
        return None
    return (
        f"too few out-of-sample residuals for an 80 % interval ({runs} runs from {sources} sources; it takes "
        f"{MIN_INTERVAL_RUNS} from {MIN_INTERVAL_SOURCES}): the set's estimates carry no interval"
    )


def calibration_report(
    params: ModelParams, cv: CrossValidation | None, crossval_asked: bool = True
) -> dict[str, Any]:
    """What `calibrate --json` prints: the set, its fitted values with their bands, which sit at a
    bound, the domain it saw and, when it was run, the cross-validation (or why it was not)."""
    out: dict[str, Any] = {
        "params": params.summary().model_dump(),
        "values": {k: b.model_dump() for k, b in params.values.items()},
        "at_bounds": params.at_bounds(),
        "domain": params.domain.model_dump(),
    }
    if cv is not None:
        out["crossval"] = cv.summary()
        if (withheld := interval_withheld(cv)) is not None:
            out["interval_withheld"] = withheld
    else:
        why = "runs from one source, nothing to leave out" if crossval_asked else "not asked for"
        if params.residuals.n:  # a memory-only fit keeps the time terms, and their interval, as they were
            out["crossval_skipped"] = f"{why}; the time terms and their interval are the prior's"
        else:
            out["crossval_skipped"] = f"{why}: no out-of-sample residuals, so its estimates carry no interval"
    return out
