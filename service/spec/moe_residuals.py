"""The out-of-sample residuals of the cost model's mixture-of-experts terms, for MoE plans' intervals.

The parameter set is fit on dense runs; its residuals say how far dense predictions land. A MoE plan
also runs code those runs never did (router, permutation, grouped GEMMs, the token exchange), and the
published MoE runs, each scored out of sample (benchmarks/moe_accuracy.py: the one parameter fit on
them, the MoE block's host time, is fit without the run's source; written to
service/catalog/checks/moe_runs.yaml with the shipped set), say how far the MoE predictions land: their
log residuals log(measured / predicted) give a MoE plan's 80 % interval beside the dense one
(`interval_bounds(..., extra=moe_residuals())`, the wider of the two on each side).
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import numpy as np
import yaml

from service.spec.params import FitRun, Residuals

MOE_CHECKS_PATH = Path(__file__).resolve().parents[1] / "catalog" / "checks" / "moe_runs.yaml"


@cache
def moe_residuals(exclude_source: str | None = None, path: Path = MOE_CHECKS_PATH) -> Residuals | None:
    """q10 / q90 of the published MoE runs' log residuals (none when the file is absent or holds fewer
    than five runs); `exclude_source` leaves one source's runs out, to score the interval on them."""
    if not path.is_file():
        return None
    runs = [FitRun.model_validate(r) for r in yaml.safe_load(path.read_text())["runs"]]
    logs = [-math.log1p(r.error) for r in runs if r.source != exclude_source]
    if len(logs) < 5:
        return None
    sources = sorted({r.source for r in runs if r.source != exclude_source})
    return Residuals(
        n=len(logs),
        q10=float(np.quantile(logs, 0.10)),
        q90=float(np.quantile(logs, 0.90)),
        method=f"published MoE runs, each scored leave-one-source-out ({', '.join(sources)})",
    )
