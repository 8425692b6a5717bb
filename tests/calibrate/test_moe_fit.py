"""The MoE block's host time is fit on published MoE runs, one fold per left-out source
(service/calibrate/moe_fit.py): planted values come back, and each source is scored on the others'."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.calibrate.fit import predict_runs
from service.calibrate.moe_fit import fit_moe_params, fit_with_loso
from service.calibrate.runs import load_dataset, measured_run
from service.spec.params import load_params

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "published" / "moe_measurements.yaml"
BRIDGE, ZOO = "megatron-bridge-perf", "megatron-moe-modelzoo"


def _planted(values: dict[str, float]):
    """The published MoE runs re-measured as the cost model predicts them with each source's value."""
    ds = load_dataset(DATA)
    runs = [measured_run(ds, row) for row in ds.measurements]
    runs = [r for r in runs if r.source in values]
    prior = load_params().with_values({"moe_block_host_s": 0.0})
    out = []
    for r in runs:
        (rate,) = predict_runs([r], prior.with_values({"moe_block_host_s": values[r.source]}))
        out.append(r.model_copy(update={"tokens_per_s_per_gpu": float(rate)}))
    return out, prior


def test_a_planted_host_time_comes_back():
    runs, prior = _planted({BRIDGE: 0.011, ZOO: 0.011})
    assert fit_moe_params(runs, prior)["moe_block_host_s"] == pytest.approx(0.011, abs=5e-5)


def test_each_source_is_scored_on_the_value_the_other_sources_give():
    # Bridge's 30B runs were re-measured with 11 ms, the zoo's with 15 ms: leaving Bridge out, the zoo's
    # value is fit, and the other way round.
    runs, prior = _planted({BRIDGE: 0.011, ZOO: 0.015})
    everywhere, folds = fit_with_loso(runs, prior)
    assert set(folds) == {BRIDGE, ZOO}
    assert folds[BRIDGE]["moe_block_host_s"] == pytest.approx(0.015, abs=5e-5)
    assert folds[ZOO]["moe_block_host_s"] == pytest.approx(0.011, abs=5e-5)
    assert 0.011 - 5e-5 <= everywhere["moe_block_host_s"] <= 0.015 + 5e-5


def test_runs_the_host_time_cannot_move_leave_the_prior():
    # The zoo's long-sequence runs do far more GPU work per block pass than the band's 30 ms.
    ds = load_dataset(DATA)
    runs = [measured_run(ds, row) for row in ds.measurements if "-s64k-" in row.id or "-s128k-" in row.id]
    assert fit_moe_params(runs, load_params())["moe_block_host_s"] == 0.0
