"""The fit recovers parameters the data were made with, stays in its bands, and says when it hits one."""

from __future__ import annotations

import numpy as np
import pytest

from service.calibrate import fit, predict_runs
from service.spec.params import ModelParams
from tests.calibrate.conftest import synthetic_runs

NAMES = ("gemm_efficiency_scale", "step_overhead_s", "inter_node_bus_efficiency")


def test_fit_recovers_known_parameters_from_noisy_runs(truth):
    runs = synthetic_runs(truth, per_source=12, noise=0.02)
    result = fit(runs, ModelParams(), NAMES)
    assert result.success and result.fitted == NAMES
    got = result.params
    assert got["gemm_efficiency_scale"] == pytest.approx(0.85, abs=0.03)
    assert got["step_overhead_s"] == pytest.approx(0.4, abs=0.15)
    assert got["inter_node_bus_efficiency"] == pytest.approx(0.6, abs=0.05)
    # Parameters not fitted keep the prior's values; the fit says what it was fit on.
    assert got["attention_backward_ratio"] == ModelParams()["attention_backward_ratio"]
    assert got.fit_runs == len(runs) and got.fit_on == ["source0", "source1", "source2"]
    # Refit on the same runs from the fitted set: they are counted once, not twice.
    again = fit(runs, got, NAMES, max_evaluations=5).params
    assert again.fit_runs == len(runs) and again.fit_on == got.fit_on
    # And it predicts the runs to within the noise, where the prior is far off.
    measured = np.array([r.tokens_per_s_per_gpu for r in runs])
    fitted_err = np.abs(np.log(predict_runs(runs, got) / measured))
    prior_err = np.abs(np.log(predict_runs(runs, ModelParams()) / measured))
    assert fitted_err.mean() < 0.03 < prior_err.mean()


def test_a_parameter_pushed_past_its_band_stops_there_and_is_reported():
    # Made with GEMMs at 0.5 × the catalog's efficiency: below the band's 0.6, physically implausible.
    truth = ModelParams().model_copy(
        update={
            "values": {
                **ModelParams().values,
                "gemm_efficiency_scale": ModelParams()
                .values["gemm_efficiency_scale"]
                .model_copy(update={"value": 0.45, "low": 0.3}),
            }
        }
    )
    runs = synthetic_runs(truth, per_source=6, noise=0.0)
    result = fit(runs, ModelParams(), ("gemm_efficiency_scale",))
    assert result.params["gemm_efficiency_scale"] == pytest.approx(0.6, abs=1e-3)
    assert result.at_bounds == {"gemm_efficiency_scale": "low"}


def test_no_runs_with_measurements_returns_the_prior_unchanged(truth):
    runs = [r.model_copy(update={"tokens_per_s_per_gpu": None}) for r in synthetic_runs(truth, 2)]
    result = fit(runs)
    assert not result.success and result.params == ModelParams()


def test_time_and_memory_parameters_are_fitted_separately(truth):
    with pytest.raises(ValueError, match="separately"):
        fit(synthetic_runs(truth, 2), names=("gemm_efficiency_scale", "activation_memory_scale"))


def test_memory_scale_fits_measured_activations(truth):
    from service.calibrate import predict_activations

    runs = synthetic_runs(truth, per_source=2)
    predicted = predict_activations(runs, ModelParams())
    runs = [r.model_copy(update={"activations_bytes": 1.2 * a}) for r, a in zip(runs, predicted, strict=True)]
    result = fit(runs, names=("activation_memory_scale",))
    assert result.params["activation_memory_scale"] == pytest.approx(1.2, rel=0.01)
