"""The issue's scenario: Llama-3-70B on 1,024 H100s at seq 8192 (16 M-token batch, as Llama 3 trained).

With fused element-wise kernels, as the published runs use, DeepSpeed's best bf16 plans are 3D (tp × pp
× dp) and ZeRO-3 over all GPUs, within the model's resolution of each other (the shipped set's
offset-free scatter: a tie), and the MFU lies near the band published for dense bf16 pre-training on
H100 clusters: 38-43 % for Llama 3 405B on 8,192-16,384 H100s (Dubey et al. 2024, Table 4). The test
asks that band to meet the estimate's own 80 % interval (the shipped set's out-of-sample residuals).
With the eager Hugging Face kernels `service train` runs, ZeRO-3 over all GPUs leads and the best 3D
plan falls further behind than with fused kernels. The service's DeepSpeed runs Ulysses cp without a
pipeline (service/catalog/engines/deepspeed.yaml), so no 3D answer carries cp.
"""

import math

from service.catalog import load_model
from service.planner import rank_plans
from service.spec import Budget, ClusterSpec, Workload
from service.spec.params import load_params

MODEL = load_model("llama3-70b")
CLUSTER = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=128)
WORKLOAD = Workload(seq_len=8192, global_batch_tokens=16 * 2**20, tokens_to_train=15e12)


def _ranking(engines, workload=WORKLOAD):
    return rank_plans(MODEL, CLUSTER, workload, Budget(objective="throughput"), engines=engines)


def _best(engines, workload=WORKLOAD):
    ranking = _ranking(engines, workload)
    row = int(ranking.selection.order[0])
    return ranking.enumeration.plans.row(row), float(ranking.estimates.mfu[row])


def test_deepspeed_answer_with_fused_kernels_ties_3d_and_zero3_with_mfu_in_the_published_band():
    ranking = _ranking(("deepspeed",), WORKLOAD.model_copy(update={"fused_elementwise": True}))
    plans, tokens = ranking.enumeration.plans, ranking.estimates.tokens_per_s
    order = [int(r) for r in ranking.selection.order]
    mfu = float(ranking.estimates.mfu[order[0]])
    three_d = next(r for r in order if plans.tp[r] > 1 and plans.pp[r] > 1)
    plan = plans.row(three_d)
    assert plan.dp > 1 and plan.zero_stage <= 1 and plan.cp == 1
    resolution = load_params().residuals.scatter
    assert tokens[three_d] >= tokens[order[0]] * math.exp(-resolution)  # 3D or ZeRO-3: a tie
    residuals = load_params().residuals  # 1,024 GPUs and seq 8,192 lie inside the fit: no widening
    low, high = mfu * math.exp(residuals.q10), mfu * math.exp(residuals.q90)
    assert low <= 0.43 and high >= 0.38, (low, mfu, high)  # the interval meets Meta's 38-43 %
    assert 0.30 <= mfu <= 0.45


def _three_d_share(workload):
    """(best plan, tokens/s of the best 3D plan over the best plan's)."""
    ranking = _ranking(("deepspeed",), workload)
    plans, tokens = ranking.enumeration.plans, ranking.estimates.tokens_per_s
    order = [int(r) for r in ranking.selection.order]
    three_d = next(r for r in order if plans.tp[r] > 1 and plans.pp[r] > 1)
    return plans.row(order[0]), float(tokens[three_d] / tokens[order[0]])


def test_with_eager_kernels_zero3_leads_and_3d_falls_further_behind():
    best, eager_share = _three_d_share(WORKLOAD)
    _, fused_share = _three_d_share(WORKLOAD.model_copy(update={"fused_elementwise": True}))
    assert best.tp == best.pp == 1 and best.zero_stage == 3
    assert 0.5 < eager_share < fused_share <= 1.0
    _, eager_mfu = _best(("deepspeed",))
    _, fused_mfu = _best(("deepspeed",), WORKLOAD.model_copy(update={"fused_elementwise": True}))
    assert eager_mfu < fused_mfu  # eager element-wise kernels cost time


def test_other_engines_are_ranked_beside_it():
    """Megatron-Core with its overlaps goes above Meta's band, into the range NVIDIA reports for its own
    stack on H100 in bf16: "up to 47% Model FLOP Utilization (MFU) on H100 clusters" (Megatron-LM
    README, weak scaling of 2B-462B models) and about 60 % for its recent Llama-3-8B recipes (the
    NVIDIA-stack runs issue #32 scored the model on)."""
    plan, mfu = _best(("deepspeed", "megatron", "fsdp"))
    assert plan.engine in ("megatron", "fsdp") and 0.47 <= mfu <= 0.60
