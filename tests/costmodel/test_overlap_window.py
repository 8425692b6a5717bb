"""Streams that hide behind the same compute share it (service/costmodel/comm.py `share_window`,
wired in service/costmodel/step_time.py): the step never gets shorter when the compute gets slower."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import comm
from service.costmodel.estimate import estimate, estimate_table
from service.plans.enumerate import enumerate_plans
from service.spec import ClusterSpec, Plan, Workload


def test_two_streams_that_each_outlast_the_compute_are_exposed_in_series():
    """Compute 1 s; streams of 1.5 s and 2 s, contention 0.1. Alone, each hides 1 s and exposes its excess
    plus a tenth of the hidden second: 0.6 and 1.1 s. Together they hide only the one second of compute:
    3.5 s of communication, 1 s of it hidden at contention, 2.6 s exposed in all, shared by what each hid."""
    raw = [np.array([1.5]), np.array([2.0])]
    alone = [comm.overlapped_exposed_s(r, 1.0, 0.1) for r in raw]
    assert [float(a[0]) for a in alone] == pytest.approx([0.6, 1.1])
    exposed, hidden = comm.share_window([(raw[0], alone[0], 0.1), (raw[1], alone[1], 0.1)], np.array([1.0]))
    assert float(exposed[0][0] + exposed[1][0]) == pytest.approx(3.5 - 1.0 + 0.1 * 1.0)
    extra = [float(e[0] - a[0]) for e, a in zip(exposed, alone, strict=True)]
    assert extra[0] == pytest.approx(extra[1]) == pytest.approx(0.45)  # each hid one second alone
    assert float(hidden[0]) == pytest.approx(1.0)


def test_streams_that_fit_in_the_compute_are_left_as_they_are():
    raw = [np.array([0.3]), np.array([0.4])]
    alone = [comm.overlapped_exposed_s(r, 1.0, 0.2) for r in raw]
    exposed, hidden = comm.share_window([(raw[0], alone[0], 0.2), (raw[1], alone[1], 0.2)], np.array([1.0]))
    assert [float(e[0]) for e in exposed] == pytest.approx([float(a[0]) for a in alone])
    assert float(hidden[0]) == pytest.approx(0.7)


def test_without_overlap_nothing_is_shared():
    exposed, hidden = comm.share_window([(np.array([2.0]), np.array([2.0]), 1.0)], np.array([1.0]))
    assert float(exposed[0][0]) == 2.0 and float(hidden[0]) == 0.0


MIXTRAL = load_model("mixtral-8x7b")
WORK = Workload(seq_len=4096, global_batch_sequences=256, tokens_to_train=2e9)


def _with_slower_memory(factor: float) -> ClusterSpec:
    gpu = load_gpu("h100-sxm-80gb")
    slower = gpu.model_copy(update={"hbm_bandwidth_gb_per_s": gpu.hbm_bandwidth_gb_per_s * factor})
    return ClusterSpec(gpu=slower, num_nodes=4)


def test_a_plan_with_four_overlapped_streams_is_not_faster_on_slower_memory():
    """Megatron-FSDP with TP, context and expert parallelism, every overlap on: the TP collectives, the
    all-to-alls and the ZeRO-3 gathers each outlast the compute. Halving HBM bandwidth slows the
    element-wise kernels; the step must not get shorter (it did by 7 % when each stream hid behind the
    whole compute on its own)."""
    plan = Plan(
        engine="megatron", dp=1, tp=8, cp=4, ep=4, expert_tp=8, zero_stage=3, micro_batch=1,
        grad_accum=256, sequence_parallel=True, comm_overlap=True, tp_comm_overlap=True,
        ep_comm_overlap=True, precision="fp8",
    )  # fmt: skip
    fast = estimate(MIXTRAL, _with_slower_memory(1.0), plan, WORK)
    slow = estimate(MIXTRAL, _with_slower_memory(0.5), plan, WORK)
    assert slow.time_breakdown_s.compute > fast.time_breakdown_s.compute
    assert slow.step_time_s >= fast.step_time_s


def test_no_plan_of_a_moe_space_gets_faster_when_its_kernels_get_slower():
    cluster = _with_slower_memory(1.0)
    plans = enumerate_plans(
        MIXTRAL, cluster, WORK, engines=("deepspeed", "fsdp", "megatron"), precision=("bf16", "fp8"), max_cp=4
    ).plans
    before = estimate_table(MIXTRAL, cluster, WORK, plans).step_time_s
    after = estimate_table(MIXTRAL, _with_slower_memory(0.5), WORK, plans).step_time_s
    assert len(plans) > 100_000
    assert np.all(after >= before * (1 - 1e-12))
