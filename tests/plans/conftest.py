"""Synthetic scored tables for the selection tests (no cost model needed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import numpy as np
import pytest

from service.costmodel.result import EstimateTable
from service.spec.plan_table import PlanTable

GIB = 1024**3


def synthetic_estimates(**cols: object) -> EstimateTable:
    """An EstimateTable whose given columns are set and all others are zeros (80 GiB limit)."""
    n = len(next(iter(cols.values())))  # type: ignore[arg-type]
    base: dict[str, np.ndarray] = {f.name: np.zeros(n) for f in fields(EstimateTable)}
    base["memory_limit_bytes"] = np.full(n, 72.0 * GIB)
    base["total_bytes"] = np.full(n, 40.0 * GIB)
    base["fits"] = np.ones(n, bool)
    for name, value in cols.items():
        base[name] = np.asarray(value, dtype=bool if name == "fits" else float)
    return EstimateTable(**base)


def labelled_plans(n: int) -> PlanTable:
    """n distinct valid plans (dp = 1..n) so messages can name them."""
    ones = np.ones(n, dtype=np.int64)
    return PlanTable.from_columns(
        dp=np.arange(1, n + 1),
        tp=ones,
        pp=ones,
        zero_stage=ones,
        offload_optimizer=ones * 0,
        offload_params=ones * 0,
        micro_batch=ones,
        grad_accum=ones,
        recompute=ones * 0,
        sequence_parallel=ones * 0,
        precision=ones * 0,
    )


@pytest.fixture
def make_estimates() -> Callable[..., EstimateTable]:
    return synthetic_estimates


@pytest.fixture
def make_plans() -> Callable[[int], PlanTable]:
    return labelled_plans
