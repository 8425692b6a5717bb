"""A MoE plan's interval also takes the out-of-sample errors of the published MoE runs kept outside the
fit (service/spec/moe_residuals.py): the numbers in the checks file, each side the wider of the two."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml

from service.catalog import load_model
from service.costmodel import estimate
from service.spec import ClusterSpec, Plan, Workload
from service.spec.moe_residuals import MOE_CHECKS_PATH, moe_residuals
from service.spec.params import load_params

WORK = Workload(seq_len=4096, global_batch_sequences=512, tokens_to_train=1e12)


def _logs(exclude: str | None = None) -> np.ndarray:
    runs = yaml.safe_load(MOE_CHECKS_PATH.read_text())["runs"]
    return np.array([-math.log1p(r["error"]) for r in runs if r["source"] != exclude])


def test_the_quantiles_are_the_checks_files_log_residuals() -> None:
    r = moe_residuals()
    assert r is not None and r.n == len(_logs()) >= 20
    assert r.q10 == pytest.approx(np.quantile(_logs(), 0.1)) and r.q90 == pytest.approx(
        np.quantile(_logs(), 0.9)
    )
    left_out = moe_residuals(exclude_source="megatron-moe-modelzoo")
    assert left_out is not None and left_out.n == len(_logs("megatron-moe-modelzoo")) < r.n
    assert "megatron-moe-modelzoo" not in left_out.method


def test_a_moe_plans_interval_is_the_wider_of_the_dense_and_the_moe_residuals() -> None:
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
    plan = Plan(dp=64, ep=8, engine="megatron", zero_stage=1, grad_accum=8, comm_overlap=True)
    moe_model = load_model("qwen3-30b-a3b")
    e = estimate(moe_model, cluster, plan, WORK)
    r, params = moe_residuals(), load_params()
    assert r is not None
    low, high = e.tokens_per_s_interval
    widening = float(params.widening(64, WORK.seq_len, "h100-sxm-80gb"))
    assert low <= e.tokens_per_s * math.exp(r.q10 * widening) * (1 + 1e-9)
    assert high >= e.tokens_per_s * math.exp(r.q90 * widening) * (1 - 1e-9)
    assert "published MoE runs, each scored leave-one-source-out" in e.params.interval
    dense = estimate(
        load_model("llama3-8b"), cluster, Plan(dp=64, engine="megatron", zero_stage=1, grad_accum=8), WORK
    )
    assert "MoE" not in dense.params.interval
    dense_low, dense_high = (x / dense.tokens_per_s for x in dense.tokens_per_s_interval)
    # each side the wider of the two; the MoE runs' errors are wider than the dense ones on at least one
    assert low / e.tokens_per_s <= dense_low * (1 + 1e-9) and high / e.tokens_per_s >= dense_high * (1 - 1e-9)
    assert low / e.tokens_per_s < dense_low or high / e.tokens_per_s > dense_high
