"""The 1F1B all-to-all overlap as Megatron-Core schedules it: block by block, each all-to-all beside the
compute it is paired with (expert_exchange.paired_exposed_s)."""

from __future__ import annotations

import pytest

from service.costmodel.expert_exchange import overlap_paired_share, paired_exposed_s


def exposed(
    x: float, a_f: float, a_b: float, m: float, blocks: int = 1, ga: int = 2, rest: float = 0.0
) -> float:
    """One micro-batch's exposed exchange: `blocks` MoE blocks, each with four all-to-alls of x seconds,
    at contention 0; `rest` more seconds of exchange outside the pairs (a recomputed forward's)."""
    a2a = blocks * 4 * x + rest
    return float(paired_exposed_s(a2a, x, a_f, a_b, m, blocks, overlap_paired_share(1, 1, ga), 0.0))


def test_a_block_with_room_on_both_sides_hides_all_four_all_to_alls():
    # combine_bwd | attn_fwd 2; dispatch_fwd, dispatch_bwd | mlp_bwd, mlp_dw, mlp_fwd 3 × 1; combine_fwd |
    # attn_bwd 4: every all-to-all (1 s) runs beside longer compute. Half the micro-batches pair (ga 2).
    assert exposed(1.0, 2.0, 4.0, 1.0) == pytest.approx(0.5 * 4.0)  # the unpaired half stays exposed
    assert exposed(1.0, 2.0, 4.0, 1.0, ga=10**6) == pytest.approx(0.0, abs=1e-5)


def test_a_short_attention_leaves_its_combines_exposed_however_long_the_experts_run():
    """The combines pair with the attention sides only: 1 s each beside 0.25 s of attention leaves
    0.75 s each exposed, though the experts' 3 × 10 s could hold all four (a step-wide comparison,
    4 s of exchange against 30 s of compute, would have hidden them)."""
    assert exposed(1.0, 0.25, 0.25, 10.0, ga=10**6) == pytest.approx(1.5, rel=1e-5)


def test_the_middle_phase_waits_on_its_data():
    """dispatch_bwd needs mlp_bwd's output and mlp_fwd needs dispatch_fwd's: with 2 s all-to-alls
    beside 1 s expert passes, the middle phase takes max(max(2, 1) + 2, max(2, 2) + 1) = 4 s against
    3 s of compute, so 1 s of its 4 s of exchange shows; the attention sides hide their combines."""
    assert exposed(2.0, 5.0, 5.0, 1.0, ga=10**6) == pytest.approx(1.0, rel=1e-5)


def test_blocks_add_up_and_what_lies_outside_the_pairs_stays_exposed():
    one = exposed(1.0, 0.25, 0.25, 10.0, ga=10**6)
    assert exposed(1.0, 0.25, 0.25, 10.0, blocks=3, ga=10**6) == pytest.approx(3 * one, rel=1e-5)
    # a fully recomputed forward's exchange (2 s more) is not in any pair
    assert exposed(1.0, 0.25, 0.25, 10.0, ga=10**6, rest=2.0) == pytest.approx(one + 2.0, rel=1e-5)


def test_without_a_second_micro_batch_nothing_hides():
    assert exposed(1.0, 2.0, 4.0, 1.0, ga=1) == pytest.approx(4.0)


def test_a_pipelines_warm_up_and_cool_down_run_alone():
    """Megatron's interleaved schedule warms the first stage up with 2(pp - 1) + (v - 1)pp chunk forwards,
    one more with the overlap on; only the rest pair. pp 8 x 4 chunks, 128 micro-batches: 39 of 512
    chunk passes alone. Without a pipeline, the first forward and the last backward."""
    assert overlap_paired_share(8, 4, 128) == pytest.approx((512 - 39) / 512)
    assert overlap_paired_share(16, 2, 120) == pytest.approx((240 - 47) / 240)
    assert overlap_paired_share(1, 1, 4) == pytest.approx(3 / 4)
    assert overlap_paired_share(4, 1, 16) == pytest.approx(12 / 16)  # 1F1B's pp - 1, plus one
    assert overlap_paired_share(8, 4, 8) == pytest.approx(0.0)  # the warm-up takes every pass


def test_what_hides_still_costs_the_contention_of_running_beside_compute():
    hidden = float(paired_exposed_s(4.0, 1.0, 2.0, 4.0, 1.0, 1, 1.0, 0.25))
    assert hidden == pytest.approx(0.25 * 4.0, rel=1e-5)


def test_deepeps_kernels_take_their_sms_from_the_compute_beside_them():
    """DeepEP holds 20 SMs while it runs, HybridEP the 32 NVIDIA's recipes give it: the compute beside a
    hidden exchange runs on the rest, 20/132 on Hopper, 20/148 on B200; NCCL's all-to-all keeps the
    fitted contention, as does a GPU whose SMs the catalog does not count, and the fitted value is a
    floor."""
    from service.catalog import load_gpu
    from service.costmodel.expert_exchange import DEEPEP_SMS, overlap_contention
    from service.spec import Plan
    from service.spec.plan_table import PlanTable

    table = PlanTable.from_plans(
        [Plan(engine="megatron", dp=16, ep=16, zero_stage=1), Plan(dp=16, ep=16, zero_stage=1)]
    )
    h100, b200 = load_gpu("h100-sxm-80gb"), load_gpu("b200-sxm-180gb")
    assert DEEPEP_SMS == 20 and h100.sm_count == 132 and b200.sm_count == 148
    megatron, deepspeed = overlap_contention(table, "deepep", h100, 0.04)
    assert megatron == pytest.approx(20 / 132) and deepspeed == pytest.approx(0.04)
    assert overlap_contention(table, "deepep", b200, 0.04)[0] == pytest.approx(20 / 148)
    assert overlap_contention(table, "alltoall", h100, 0.04)[0] == pytest.approx(0.04)
    assert overlap_contention(table, "hybridep", h100, 0.04)[0] == pytest.approx(32 / 132)
    uncounted = h100.model_copy(update={"sm_count": None})
    assert overlap_contention(table, "deepep", uncounted, 0.04)[0] == pytest.approx(0.04)
    assert overlap_contention(table, "deepep", h100, 1.0)[0] == pytest.approx(1.0)  # overlap off
