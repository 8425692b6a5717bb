"""The cost model's MoE parameters (`MOE_FIT_PARAMS`: a MoE block pass's host time), fit on published MoE
runs, which the dense runs the shipped set is fit on cannot identify (they hold no MoE block).

Method, as `fit.py`'s for the dense parameters: residual of a run = log(predicted / measured tokens/s per
GPU), weighted by 1/√(runs of its source), under a Cauchy loss of scale 0.1 (`fit.LOSS`,
`fit.SOFT_L1_SCALE`). The host time is a floor (costmodel/compute.py `moe_host_floor_s`): below every
run's GPU time it moves nothing, so the loss is flat there and a gradient from the prior (0) goes
nowhere. It is searched on a grid over its band instead (`COARSE_STEPS`, then `FINE_STEPS` around the
best), the smallest value winning a tie. `fit_with_loso` fits it once per source with that source left
out, so each run is scored on a value fit without it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.calibrate.fit import SOFT_L1_SCALE, predict_runs, source_weights
from service.calibrate.runs import MeasuredRun
from service.spec.param_bands import MOE_FIT_PARAMS
from service.spec.params import ModelParams

COARSE_STEPS = 31  # 1 ms apart over the band's 30 ms
FINE_STEPS = 41  # 0.05 ms apart over ± one coarse step


def fit_moe_params(runs: Sequence[MeasuredRun], prior: ModelParams) -> ModelParams:
    """`prior` with `MOE_FIT_PARAMS` fit on `runs` (see the module docstring)."""
    return _fits(runs, prior, {"": sorted({r.source for r in runs})})[""]


def fit_with_loso(
    runs: Sequence[MeasuredRun], prior: ModelParams
) -> tuple[ModelParams, dict[str, ModelParams]]:
    """The fit on every source's runs, and per source the fit on every other source's runs (to score
    that source's runs on)."""
    sources = sorted({r.source for r in runs})
    fits = _fits(runs, prior, {"": sources} | {s: [x for x in sources if x != s] for s in sources})
    return fits.pop(""), fits


def _fits(
    runs: Sequence[MeasuredRun], prior: ModelParams, fits: dict[str, list[str]]
) -> dict[str, ModelParams]:
    """One fit per entry of `fits` (a name: the sources it is fit on), sharing the predictions: only the
    runs the host time can move (their rate differs across its band) are predicted again, once per
    value any fit tries."""
    (name,) = MOE_FIT_PARAMS
    band = prior.values[name]
    used = [r for r in runs if r.tokens_per_s_per_gpu]
    at = {x: predict_runs(used, prior.with_values({name: x})) for x in (band.low, band.high)}
    moving = [i for i, r in enumerate(used) if at[band.low][i] != at[band.high][i]]
    measured = np.array([used[i].tokens_per_s_per_gpu for i in moving], dtype=float)
    cache: dict[float, np.ndarray] = {}

    def log_ratio(x: float) -> np.ndarray:
        if x not in cache:
            rates = predict_runs([used[i] for i in moving], prior.with_values({name: x}))
            cache[x] = np.log(rates / measured)
        return cache[x]

    out = {}
    for key, sources in fits.items():
        subset = [r.source in sources for r in used]
        weights = source_weights([r for r, keep in zip(used, subset, strict=True) if keep])
        weight = dict(zip([i for i, keep in enumerate(subset) if keep], weights, strict=True))
        w = np.array([weight.get(i, 0.0) for i in moving])  # 0: a run of a left-out source

        def best(grid: np.ndarray, w: np.ndarray = w) -> float:
            # Cauchy, ρ(z²) = ln(1 + z²); the runs the host time cannot move add a constant, left out.
            losses = [np.sum(np.log1p((w * log_ratio(float(x)) / SOFT_L1_SCALE) ** 2)) for x in grid]
            return float(grid[int(np.argmin(losses))])  # the first, i.e. smallest, of equal losses

        coarse = np.linspace(band.low, band.high, COARSE_STEPS)
        step = coarse[1] - coarse[0]
        centre = best(coarse)
        fine = np.linspace(max(band.low, centre - step), min(band.high, centre + step), FINE_STEPS)
        out[key] = prior.with_values({name: best(fine)})
    return out
