"""benchmarks/search_efficiency.py's committed results agree with their own trial rows: the grid's best,
the target, the guided search's first trial within it, its fraction of the grid and the rank
correlation are recomputed from the measured and predicted tokens/s the file records."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "search_efficiency", ROOT / "benchmarks" / "search_efficiency.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_results_follow_from_their_trials():
    se = _benchmark()
    data = json.loads((ROOT / "benchmarks" / "results" / "search_efficiency.json").read_text())
    grid = [r for r in data["grid"] if r["status"] == "ok"]
    best = max(grid, key=lambda r: r["measured_tokens_per_s"])
    assert data["grid_best"]["plan"] == best["plan"]
    assert data["target_tokens_per_s"] == pytest.approx((1 - data["within"]) * best["measured_tokens_per_s"])
    first = se._first_within(data["guided"], data["target_tokens_per_s"])
    assert first == data["guided_trials_to_within"]
    assert data["guided_fraction_of_grid"] == pytest.approx(first / data["grid_trials"])
    assert data["goal_met"] == (data["guided_fraction_of_grid"] <= data["goal_fraction"])
    rho = se._spearman(
        [r["predicted_tokens_per_s"] for r in grid], [r["measured_tokens_per_s"] for r in grid]
    )
    assert rho == pytest.approx(data["spearman_predicted_vs_measured"])


def test_spearman_and_first_within_on_known_rows():
    se = _benchmark()
    assert se._spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert se._spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    rows = [{"trial": 1, "measured_tokens_per_s": 5.0}, {"trial": 2, "measured_tokens_per_s": None},
            {"trial": 3, "measured_tokens_per_s": 9.8}]  # fmt: skip
    assert se._first_within(rows, 9.7) == 3 and se._first_within(rows, 11.0) is None
