"""The issue's scenario: Llama-3-70B on 1,024 H100s at seq 8192 (16 M-token batch, as Llama 3 trained).

With fused element-wise kernels, as the published runs use, DeepSpeed's best bf16 plans are 3D (tp × pp
× dp) and ZeRO-3 with hpZ over all GPUs, within 5 % of each other (v13: 0.3 %; v14, whose fit puts
the cost of a collective overlapped with compute at 0.045 of its time instead of 0.13: 3.5 %; v16:
2.2 %; v17: 3.9 %), and the MFU lies near the band published for dense bf16 pre-training on H100
clusters: 38-43 % for Llama 3 405B on 8,192-16,384 H100s (Dubey et al. 2024, Table 4). The test asks
that band to meet the estimate's own 80 % interval (the shipped set's out-of-sample residuals, about
−13 … +17 %). With the eager Hugging Face kernels `service train` runs, ZeRO-3 over all GPUs leads and
the best 3D plan stays within 15 % of it (v13: 5.0 % behind; v14: 10.1 %; v16: 9.9 %; v17: 12.6 %).
The service's DeepSpeed runs Ulysses cp without a pipeline (service/catalog/engines/deepspeed.yaml), so
no 3D answer carries cp.
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
    assert tokens[three_d] >= 0.95 * tokens[order[0]]  # 3D or ZeRO-3 over all GPUs: close
    residuals = load_params().residuals  # 1,024 GPUs and seq 8,192 lie inside the fit: no widening
    low, high = mfu * math.exp(residuals.q10), mfu * math.exp(residuals.q90)
    assert low <= 0.43 and high >= 0.38, (low, mfu, high)  # the interval meets Meta's 38-43 %
    assert 0.30 <= mfu <= 0.45


def test_with_eager_kernels_the_best_3d_plan_stays_close_to_the_best():
    ranking = _ranking(("deepspeed",))
    plans, tokens = ranking.enumeration.plans, ranking.estimates.tokens_per_s
    order = [int(r) for r in ranking.selection.order]
    three_d = next(r for r in order if plans.tp[r] > 1 and plans.pp[r] > 1)
    assert tokens[three_d] >= 0.85 * tokens[order[0]]
    _, fused_mfu = _best(("deepspeed",), WORKLOAD.model_copy(update={"fused_elementwise": True}))
    assert float(ranking.estimates.mfu[order[0]]) < fused_mfu  # eager element-wise kernels cost time


def test_other_engines_are_ranked_beside_it():
    """Megatron-Core with its overlaps goes above Meta's band but not above what NVIDIA reports for it:
    "up to 47% Model FLOP Utilization (MFU) on H100 clusters" (Megatron-LM README, bf16 weak scaling,
    2B-462B models), printed to the percent; the estimate may pass it by less than a point, a small
    fraction of its 80 % interval (about ±15 %). v13 predicted 47.3 %, v14 47.5 %, v15 and v16 47.8 %,
    v17 47.99 %: a hair under the bound, which was not moved."""
    plan, mfu = _best(("deepspeed", "megatron", "fsdp"))
    assert plan.engine in ("megatron", "fsdp") and 0.34 <= mfu < 0.48
