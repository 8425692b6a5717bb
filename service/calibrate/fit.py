"""Fits `ModelParams` on measured runs: a robust least-squares fit of log(predicted / measured),
each parameter bounded to its physical band.

Method (stated wherever a fitted set is used):
- residual of a run = log(cost model's tokens/s per GPU / measured), weighted by 1/√(runs of its
  source): under a squared loss every source would count as much as any other however many rows it has;
- Cauchy loss (scipy.optimize.least_squares, `loss="cauchy"`, f_scale 0.1): weighted residuals beyond
  ~10 % count less and less, so a few odd runs cannot drag the parameters. The loss acts on the weighted
  residuals, so a source with many rows (their residuals shrunk by 1/√n, further inside the loss's
  quadratic part) still pulls harder than a few rows as far off: the equal weighting is approximate;
- a weak pull of each parameter towards its analytical prior (`PRIOR_WEIGHT` per unit of its band),
  so a parameter the data cannot identify stays where the physics put it instead of wandering;
- bounds = the parameter's band (`ModelParams.values[...].low/high`); one that ends on an edge is
  reported (`ModelParams.at_bounds`).
Memory parameters are fitted the same way on measured activations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.calibrate.runs import MeasuredRun
from service.spec.param_bands import MEMORY_PARAMS, PUBLISHED_FIT_PARAMS
from service.spec.params import ModelParams

# Pull towards the prior, per band width: a parameter moved across its whole band costs as much as
# one source predicted e^PRIOR_WEIGHT-fold off; small enough that data decides, large enough that an
# unidentified parameter keeps its prior.
PRIOR_WEIGHT = 0.05
LOSS = "cauchy"
SOFT_L1_SCALE = 0.1


def predict_runs(runs: Sequence[MeasuredRun], params: ModelParams) -> np.ndarray:
    """The cost model's tokens/s per GPU for each run under `params` (no memory headroom: the runs ran)."""
    from service.costmodel.estimate import tokens_per_s_per_gpu

    return np.array(
        [float(tokens_per_s_per_gpu(r.model, r.cluster, r.workload, r.plan_table(), params)[0]) for r in runs]
    )


def predict_activations(runs: Sequence[MeasuredRun], params: ModelParams) -> np.ndarray:
    """The cost model's saved-activation bytes per GPU for each run under `params`."""
    from service.costmodel import estimate_table

    return np.array(
        [
            float(
                estimate_table(r.model, r.cluster, r.workload, r.plan_table(), 0.0, params).activations_bytes[
                    0
                ]
            )
            for r in runs
        ]
    )


def _measured(runs: Sequence[MeasuredRun], memory: bool) -> np.ndarray:
    key = "activations_bytes" if memory else "tokens_per_s_per_gpu"
    return np.array([getattr(r, key) for r in runs], dtype=float)


def source_weights(runs: Sequence[MeasuredRun]) -> np.ndarray:
    counts = Counter(r.source for r in runs)
    return np.array([1.0 / np.sqrt(counts[r.source]) for r in runs])


@dataclass(frozen=True)
class Calibration:
    """A fit's result: the fitted set, which parameters moved, which hit a bound, the in-sample error."""

    params: ModelParams
    fitted: tuple[str, ...]
    at_bounds: dict[str, str]
    in_sample_log_residuals: np.ndarray
    runs: int
    success: bool
    message: str


def fit(
    runs: Sequence[MeasuredRun],
    prior: ModelParams | None = None,
    names: Sequence[str] = PUBLISHED_FIT_PARAMS,
    name: str = "fitted",
    max_evaluations: int = 400,
) -> Calibration:
    """Fits the parameters `names` of `prior` on `runs`; the others keep their values.

    Time parameters use the runs' measured tokens/s per GPU; memory parameters (`MEMORY_PARAMS`) their
    measured activations. Runs without the measured quantity are ignored; with none left, `prior` is
    returned unchanged (`success` False).
    """
    from scipy.optimize import least_squares

    prior = prior or ModelParams()
    names = tuple(names)
    memory = all(n in MEMORY_PARAMS for n in names)
    if not memory and any(n in MEMORY_PARAMS for n in names):
        raise ValueError("fit time and memory parameters separately (they use different measurements)")
    used = [r for r in runs if getattr(r, "activations_bytes" if memory else "tokens_per_s_per_gpu")]
    if not used or not names:
        return Calibration(prior, (), prior.at_bounds(), np.zeros(0), 0, False, "no measured runs to fit on")
    measured = _measured(used, memory)
    weights = source_weights(used)
    bands = [prior.values[n] for n in names]
    lo = np.array([b.low for b in bands])
    span = np.array([b.high - b.low for b in bands])
    x0 = (np.array([b.value for b in bands]) - lo) / span
    predict = predict_activations if memory else predict_runs

    def params_at(x: np.ndarray) -> ModelParams:
        return prior.with_values(dict(zip(names, lo + np.clip(x, 0, 1) * span, strict=True)))

    def residuals(x: np.ndarray) -> np.ndarray:
        log_ratio = np.log(predict(used, params_at(x)) / measured)
        return np.concatenate([weights * log_ratio, PRIOR_WEIGHT * (x - x0)])

    result = least_squares(
        residuals,
        np.clip(x0, 1e-6, 1 - 1e-6),
        bounds=(0.0, 1.0),
        loss=LOSS,
        f_scale=SOFT_L1_SCALE,
        diff_step=1e-3,
        max_nfev=max_evaluations,
    )
    # What the set was fit on accumulates: a memory fit on proxies over the published set's time terms
    # was fit on both. A refit on sources the prior already saw counts their runs once, not twice.
    used_sources = {r.source for r in used}
    sources = sorted(used_sources | set(prior.fit_on))
    earlier = 0 if used_sources & set(prior.fit_on) else prior.fit_runs
    params = params_at(result.x).model_copy(
        update={
            "name": name,
            "fit_on": sources,
            "fit_runs": earlier + len(used),
            "version": prior.version,
        }
    )
    log_res = np.log(measured / predict(used, params))
    at = {k: v for k, v in params.at_bounds().items() if k in names}
    return Calibration(params, names, at, log_res, len(used), bool(result.success), str(result.message))
