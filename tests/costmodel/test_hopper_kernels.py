"""Kernel rates on Hopper that depend on the software stack: FP8 GEMMs short of twice the bf16 rate,
Transformer Engine's fitted GEMM rate, and torch SDPA's cuDNN attention from torch 2.11."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import estimate, fp8
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import ModelParams

PRIOR = ModelParams()
LLAMA8 = load_model("llama3-8b")
WORK = Workload(seq_len=8192, global_batch_sequences=16, tokens_to_train=1e9)


def _compute_s(plan: Plan, gpu: str = "h100-sxm-80gb", params: ModelParams = PRIOR, **workload) -> float:
    cluster = ClusterSpec(gpu=gpu, num_nodes=1)
    est = estimate(LLAMA8, cluster, plan, WORK.model_copy(update=workload), params=params)
    return est.time_breakdown_s.compute


def test_fp8_gemms_run_at_their_own_share_of_the_fp8_peak():
    """H100: 0.565 of the FP8 peak against bf16's 0.706 of its own (FBGEMM #2546: 0.80 of twice bf16)."""
    h100 = load_gpu("h100-sxm-80gb")
    assert h100.fp8_gemm_efficiency_max / h100.gemm_efficiency_max == pytest.approx(0.80, abs=0.01)
    bf16_peak = h100.peak_tflops_bf16 * 1e12
    rate = fp8.gemm_peak_flops(np.array([3, 0]), h100, bf16_peak)  # fp8, bf16
    # The GEMM time applies gemm_efficiency_max; the scaled FP8 rate lands at fp8_gemm_efficiency_max.
    assert rate[0] * h100.gemm_efficiency_max == pytest.approx(h100.peak_tflops_fp8 * 1e12 * 0.565)
    assert rate[1] == bf16_peak
    # A GPU with no FP8 measurement keeps the bf16 share of its FP8 peak.
    b200 = load_gpu("b200-sxm-180gb")
    assert b200.fp8_gemm_efficiency_max is None
    assert fp8.gemm_peak_flops(np.array([3]), b200, 1.0)[0] == pytest.approx(b200.peak_tflops_fp8 * 1e12)


def test_te_gemm_scale_speeds_transformer_engine_on_hopper_only():
    fast = PRIOR.with_values({"te_gemm_scale": 1.25})
    megatron = Plan(tp=8, grad_accum=16, sequence_parallel=True, engine="megatron")
    deepspeed = Plan(dp=8, zero_stage=3, grad_accum=2)
    ratio = _compute_s(megatron, params=fast) / _compute_s(megatron)
    # GEMMs are most of a Llama-3-8B block's time at seq 8192: between 1/1.25 and 1.
    assert 1 / 1.25 < ratio < 0.9
    # No Transformer Engine (DeepSpeed), or no Hopper kernels (A100): the scale does nothing.
    assert _compute_s(deepspeed, params=fast) == pytest.approx(_compute_s(deepspeed))
    a100 = "a100-sxm-80gb"
    assert _compute_s(megatron, a100, params=fast) == pytest.approx(_compute_s(megatron, a100))


def test_sdpa_runs_cudnn_attention_on_hopper_from_torch_2_11():
    """The default Workload is this service's stack (torch 2.13): SDPA's cuDNN kernel on Hopper, as fast
    as Transformer Engine's; `cudnn_attention: false` is FlashAttention-2, 0.53/0.35 slower there."""
    plan = Plan(dp=8, zero_stage=3, grad_accum=2)
    assert Workload.model_fields["cudnn_attention"].default is True
    cudnn, flash2 = _compute_s(plan), _compute_s(plan, cudnn_attention=False)
    assert 0.80 < cudnn / flash2 < 0.97  # attention is ~1/4 of the math at 8k tokens
    # A100 has no faster kernel in the catalog: the flag changes nothing there.
    a100 = "a100-sxm-80gb"
    assert _compute_s(plan, a100) == pytest.approx(_compute_s(plan, a100, cudnn_attention=False))
