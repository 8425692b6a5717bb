"""Intervals honest about where the fit is thin: the software stack of a plan, the widening of an
unseen stack, the offset-free scatter and the nearest fitted runs the memo prints."""

from __future__ import annotations

import numpy as np
import pytest

from service.calibrate.crossval import offset_free_scatter
from service.calibrate.nearest import (
    describe,
    describe_checks,
    nearest_checks,
    nearest_runs,
    published_checks,
)
from service.catalog import load_model
from service.costmodel import estimate
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import Domain, ModelParams, Residuals, load_params
from service.spec.plan_table import PlanTable
from service.spec.stack import stack_names

WORKLOAD = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)


def test_stack_names_separate_the_code_paths():
    plans = PlanTable.from_plans(
        [
            Plan(dp=32, zero_stage=3),
            Plan(dp=16, tp=2, zero_stage=1),
            Plan(dp=32, zero_stage=1),
            Plan(dp=32, zero_stage=3, engine="fsdp"),
            Plan(dp=16, tp=2, zero_stage=3, engine="fsdp"),
            Plan(dp=8, tp=4, zero_stage=1, engine="megatron"),
        ]
    )
    assert stack_names(plans).tolist() == [
        "DeepSpeed ZeRO-3, bf16",
        "DeepSpeed 3D, bf16",
        "DeepSpeed ZeRO-0/1/2, bf16",
        "FSDP, bf16",
        "FSDP + TP/PP, bf16",
        "Megatron, bf16",
    ]
    assert stack_names(plans.take(np.array([0])), legacy_zero3=True)[0] == "DeepSpeed ZeRO-3 before 0.6, bf16"


def test_an_unseen_stack_is_widened_on_a_seen_gpu_and_not_twice_on_an_unseen_one():
    params = ModelParams(
        residuals=Residuals(n=10, q10=-0.1, q90=0.1),
        domain=Domain(max_gpus=64, max_seq_len=8192, gpu_types=["a100-sxm-80gb", "h100-sxm-80gb"],
                      stacks=["FSDP, bf16 on h100-sxm-80gb", "Megatron, bf16 on a100-sxm-80gb"]),
    )  # fmt: skip
    w = params.widening(32, 4096, "h100-sxm-80gb", ["FSDP, bf16", "Megatron, bf16", "DeepSpeed ZeRO-3, bf16"])
    assert w.tolist() == [1.0, 1.5, 1.5]  # Megatron bf16 was fit on A100 only
    # On an unseen GPU the GPU rule widens already; the stack adds only if no GPU saw it.
    w = params.widening(32, 4096, "h200-sxm-141gb", ["FSDP, bf16", "FSDP + TP/PP, bf16"])
    assert w.tolist() == [1.5, 2.0]
    assert params.widening(32, 4096, "h100-sxm-80gb", None) == 1.0  # no stacks given: rule off


def test_the_seeds_stack_is_outside_the_shipped_fit_so_its_interval_is_wider():
    """DeepSpeed's ZeRO-3 (0.6 and later) on H100 is in no fitted source: the seed's ZeRO-3 interval is
    widened by half; FSDP on H100 (IBM, MosaicML, torchtitan) is not."""
    params = load_params()
    model, cluster = load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    ds = estimate(
        model, cluster, Plan(dp=32, zero_stage=3, micro_batch=1, grad_accum=4), WORKLOAD, params=params
    )
    fsdp = estimate(
        model,
        cluster,
        Plan(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, engine="fsdp"),
        WORKLOAD,
        params=params,
    )
    q10, q90 = params.residuals.q10, params.residuals.q90
    lo, hi = ds.tokens_per_s_interval
    assert lo == pytest.approx(ds.tokens_per_s * np.exp(1.5 * q10))
    assert hi == pytest.approx(ds.tokens_per_s * np.exp(1.5 * q90))
    lo, hi = fsdp.tokens_per_s_interval
    assert hi == pytest.approx(fsdp.tokens_per_s * np.exp(q90))


def test_offset_free_scatter_takes_each_sources_offset_out():
    # Source a is +0.2 throughout (an offset, no scatter); source b scatters ±0.1 about 0.
    res = np.array([0.2, 0.2, 0.2, 0.1, -0.1])
    assert offset_free_scatter(res, ["a", "a", "a", "b", "b"]) == pytest.approx(np.sqrt(0.5 * 0.01))


def test_the_shipped_scatter_is_the_one_its_runs_give():
    params = load_params()
    errors = np.array([r.error for r in params.runs])
    log_res = -np.log1p(errors)  # log(measured / predicted)
    assert len(params.runs) == params.fit_runs == 158
    assert params.residuals.scatter == pytest.approx(
        offset_free_scatter(log_res, [r.source for r in params.runs])
    )


def test_nearest_runs_for_the_seed_name_the_closest_stack_and_deepspeeds_own_evidence():
    near = nearest_runs(load_params(), "DeepSpeed ZeRO-3, bf16", "h100-sxm-80gb", 13.0, 32)
    assert near[0].gpu == "h100-sxm-80gb" and 10 < near[0].params_b < 16
    assert any(r.stack.startswith("DeepSpeed") for r in near)  # the engine's own (2021) runs, however far
    line = describe(near[0])
    assert f"predicted {near[0].error:+.1%}" in line and near[0].source in line


def test_runs_kept_outside_the_fit_name_the_seeds_stack_and_a_plans_own_gpu():
    """The memo's second list: published runs no parameter was fit on, one line per source, model and
    stack, nearest first; a plan on a GPU none of the nearest ran on also gets its own GPU's."""
    checks = published_checks()
    assert {r.id for r in checks} >= {
        "trainy-h200-llama3.1-8b-n32-compile-float8",
        "zoo-mixtral-8x22b-h100-n128-forced",
    }
    seed = nearest_checks("DeepSpeed ZeRO-3, bf16", "h100-sxm-80gb", 13.0, 32)
    assert seed[0] and all(r.source == "deepcompile-zero3" for r in seed[0]) and len(seed[0]) == 12
    errors = sorted(r.error for r in seed[0])
    line = describe_checks(seed[0])
    assert line.startswith(
        "deepcompile-zero3: 12 runs of llama3-70b (71B), DeepSpeed ZeRO-3, bf16 on 32 × h100"
    )
    assert f"predicted {errors[0]:+.1%} to {errors[-1]:+.1%} (median " in line
    h200 = nearest_checks("FSDP, bf16", "h200-sxm-141gb", 8.0, 64)
    assert [g[0].source for g in h200] == ["torchtitan-h100-compile", "trainy-h200-compile"]
    assert all(r.error < -0.1 for r in h200[-1])  # the H200 runs: predicted too slow
    assert describe_checks(h200[-1]).startswith(
        "trainy-h200-compile: 2 runs of llama3-8b (8B), FSDP, fp8 on 32–64 ×"
    )
    # a 70B FSDP plan on 256 H200: neither of the two nearest ran on an H200, so its GPU's runs come third
    big = nearest_checks("FSDP, bf16", "h200-sxm-141gb", 70.0, 256)
    assert len(big) == 3 and all(g[0].gpu != "h200-sxm-141gb" for g in big[:2])
    assert big[2][0].source == "trainy-h200-compile"
    one = describe_checks((h200[-1][0],))
    assert f"({h200[-1][0].plan}), predicted {h200[-1][0].error:+.1%}" in one
