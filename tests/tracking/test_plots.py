"""Search plots: PNG files with the trials' data; no plot when there is nothing to draw."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg

from service.spec.record import Observation
from service.tracking.plots import measured_vs_predicted, search_plots, throughput_per_plan

DATA = [
    {
        "label": "dp2-z1-mb2",
        "measured": {
            "tokens_per_s": 1100.0,
            "peak_memory_bytes_per_rank": 9.0e8,
            "model_state_bytes_per_rank": 1.2e7,
        },
        "predicted": {
            "tokens_per_s": 8700.0,
            "peak_memory_bytes_per_rank": 8.8e8,
            "model_state_bytes_per_rank": 1.1e7,
        },
    },
    {
        "label": "dp2-z3-mb4",
        "measured": {
            "tokens_per_s": 1500.0,
            "peak_memory_bytes_per_rank": 9.5e8,
            "model_state_bytes_per_rank": 0.8e7,
        },
        "predicted": {
            "tokens_per_s": 11000.0,
            "peak_memory_bytes_per_rank": 8.4e8,
            "model_state_bytes_per_rank": 0.8e7,
        },
    },
    {"label": "dp2-z1-mb1024 (oom)", "measured": {}, "predicted": {"tokens_per_s": 13000.0}},
]
ROWS = [
    (r["label"], Observation(measured=r["measured"], predicted=r["predicted"]))  # type: ignore[arg-type]
    for r in DATA
]


def test_search_plots_are_written(tmp_path: Path) -> None:
    paths = search_plots(ROWS, tmp_path)
    assert [p.name for p in paths] == [
        "tokens_per_s_measured_vs_predicted.png",
        "peak_memory_measured_vs_predicted.png",
        "model_state_measured_vs_predicted.png",
        "tokens_per_s_per_plan.png",
    ]
    for path in paths:
        image = mpimg.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # something is drawn, not a blank canvas


def test_nothing_to_draw_gives_no_file(tmp_path: Path) -> None:
    assert measured_vs_predicted(ROWS[2:], "tokens_per_s", "tokens/s", 1.0, tmp_path / "a.png") is None
    assert throughput_per_plan([], "tokens_per_s", tmp_path / "b.png") is None
    assert not list(tmp_path.iterdir())
