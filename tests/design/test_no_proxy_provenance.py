"""`run --no-proxies` on a CPU experiment (whose "proxies" would run on the production device type):
no proxy ran and nothing was calibrated, so no number says "calibrated on proxies" (issue #35)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.report.result import CALIBRATED, PRIOR, PUBLISHED
from tests.design.conftest import tiny_experiment


@pytest.mark.slow  # ~35 s on 2 cores: the whole pipeline, memo and MLflow included (no Ray)
def test_no_proxies_means_no_calibrated_tag(tmp_path: Path) -> None:
    from service import Run

    result = Run(
        tiny_experiment(tmp_path, "no-proxies"), storage_path=tmp_path / "out", run_proxies=False
    ).fit()
    assert result.calibration.status.startswith("not calibrated") and result.proxies == []
    assert result.rows
    tags = {getattr(row, name).tag for row in result.rows for name in ("tokens_per_s", "hours", "dollars")}
    tags |= {row.memory_per_gpu_bytes.tag for row in result.rows}
    assert CALIBRATED not in tags and tags <= {PRIOR, PUBLISHED}
    assert result.predicted is not None and result.predicted.dollars.tag != CALIBRATED
