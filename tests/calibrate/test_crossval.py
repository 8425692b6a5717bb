"""Leave-one-source-out scores each source with parameters fit without it; intervals come from
out-of-sample residuals, narrow as runs are added, and widen outside the fitted domain."""

from __future__ import annotations

import numpy as np
import pytest

from service.calibrate.crossval import (
    MIN_INTERVAL_RUNS,
    calibrate,
    calibration_report,
    leave_one_source_out,
    weighted_quantile,
)
from service.spec.params import Domain, ModelParams, Residuals, interval_bounds
from tests.calibrate.conftest import synthetic_runs

NAMES = ("gemm_efficiency_scale", "step_overhead_s", "inter_node_bus_efficiency")


def _width(params: ModelParams) -> float:
    return params.residuals.q90 - params.residuals.q10


def test_held_out_sources_are_predicted_by_folds_that_never_saw_them(truth):
    runs = synthetic_runs(truth, per_source=6, noise=0.03)
    cv = leave_one_source_out(runs, ModelParams(), NAMES)
    assert set(cv.per_source) == {"source0", "source1", "source2"}
    for source, score in cv.per_source.items():
        assert source not in score.params.fit_on and score.params.fit_runs == 12
        assert score.n == 6 and score.mape < 0.1
    assert set(cv.log_residuals) == {r.id for r in runs}
    assert 0.0 <= cv.coverage <= 1.0


def test_intervals_narrow_as_runs_are_added(truth):
    # Twelve runs give a noisy width (a draw can come out narrower than thirty runs do): compare the
    # mean over three draws of the noise.
    def fitted(per_source: int, seed: int) -> ModelParams:
        runs = synthetic_runs(truth, per_source=per_source, noise=0.05, seed=seed)
        return calibrate(runs, ModelParams(), NAMES)[0]

    few, many = [fitted(4, s) for s in (1, 2, 3)], [fitted(10, s) for s in (1, 2, 3)]
    assert all(p.residuals.n == 12 for p in few) and all(p.residuals.n == 30 for p in many)
    assert np.mean([_width(p) for p in many]) < np.mean([_width(p) for p in few])
    domain = many[0].domain
    assert domain.max_gpus == 128 and "h100-sxm-80gb" in domain.gpu_types


def test_interval_widens_outside_the_fitted_domain():
    params = ModelParams(
        residuals=Residuals(n=50, q10=-0.1, q90=0.1),
        domain=Domain(max_gpus=64, max_seq_len=4096, gpu_types=["h100-sxm-80gb"]),
    )
    inside = interval_bounds(1000.0, params, 64, 4096, "h100-sxm-80gb")
    more_gpus = interval_bounds(1000.0, params, 256, 4096, "h100-sxm-80gb")  # two doublings beyond
    other_gpu = interval_bounds(1000.0, params, 64, 4096, "a100-sxm-80gb")
    assert inside[0] == pytest.approx(1000 * np.exp(-0.1)) and inside[1] == pytest.approx(1000 * np.exp(0.1))
    assert more_gpus[1] == pytest.approx(1000 * np.exp(0.1 * (1 + 2 * params.widen_per_doubling)))
    assert other_gpu[1] == pytest.approx(1000 * np.exp(0.1 * (1 + params.widen_unseen_gpu)))
    # No residuals (the uncalibrated prior): the interval is the point, not a made-up band.
    assert interval_bounds(1000.0, ModelParams(), 64, 4096, "h100-sxm-80gb") == (1000.0, 1000.0)


def test_weighted_quantile_gives_each_source_equal_weight():
    values = np.array([0.0] * 9 + [1.0])
    equal = np.ones(10)
    by_source = np.array([1 / 9] * 9 + [1.0])  # nine runs of one source, one of another
    # Equal weights: the 90th percentile sits halfway to the one outlier; by source, it is the outlier's
    # half of the weight, so the percentile moves up to it.
    assert weighted_quantile(values, equal, 0.9) == pytest.approx(0.5)
    assert weighted_quantile(values, by_source, 0.9) == pytest.approx(1.0)


def test_one_source_or_no_crossval_is_the_fit_alone_without_an_interval(truth):
    runs = synthetic_runs(truth, per_source=4, noise=0.03)
    one_source = [r for r in runs if r.source == "source0"]
    params, cv = calibrate(one_source, ModelParams(), NAMES)
    assert cv is None and not params.has_interval and params.fit_runs == 4
    asked, cv = calibrate(runs, ModelParams(), NAMES, crossval=False)
    assert cv is None and not asked.has_interval and asked.fit_runs == 12
    full, cv = calibrate(runs, ModelParams(), NAMES)
    assert cv is not None and full.has_interval
    # the fit is the same either way; only the residuals (the interval) come from cross-validation
    assert asked["gemm_efficiency_scale"] == pytest.approx(full["gemm_efficiency_scale"])


def test_too_few_residuals_give_no_interval_and_say_so(truth):
    runs = synthetic_runs(truth, per_source=1, noise=0.03)  # three runs from three sources
    params, cv = calibrate(runs, ModelParams(), NAMES)
    assert cv is not None and len(cv.log_residuals) == 3 < MIN_INTERVAL_RUNS
    assert not params.has_interval and len(params.runs) == 3  # scored, but no "80 %" band from 3 runs
    assert "too few out-of-sample residuals" in calibration_report(params, cv)["interval_withheld"]


def test_a_refit_without_crossval_drops_the_priors_interval_and_scored_runs(truth):
    runs = synthetic_runs(truth, per_source=4, noise=0.03)
    prior, _ = calibrate(runs, ModelParams(), NAMES)
    assert prior.has_interval and prior.runs
    mine = [r for r in runs if r.source == "source0"]
    refit, cv = calibrate(mine, prior, NAMES)  # one source: the fit alone
    assert cv is None and not refit.has_interval and refit.runs == []
    report = calibration_report(refit, None, crossval_asked=True)
    assert report["crossval_skipped"].startswith("runs from one source")
    assert calibration_report(refit, None, crossval_asked=False)["crossval_skipped"].startswith("not asked")


def test_a_prior_fit_on_the_held_out_source_does_not_reach_its_fold(truth):
    runs = synthetic_runs(truth, per_source=4, noise=0.03)
    sources = sorted({r.source for r in runs})
    # a prior whose values were fit on every source (as the shipped set was on the published runs)
    seen = ModelParams().with_values({"gemm_efficiency_scale": 0.7, "step_overhead_s": 0.5}, fit_on=sources)
    leaky = leave_one_source_out(runs, seen, NAMES)
    clean = leave_one_source_out(runs, ModelParams(), NAMES)
    for s in sources:
        for name in NAMES:
            assert leaky.per_source[s].params[name] == pytest.approx(
                clean.per_source[s].params[name], rel=1e-9
            )
