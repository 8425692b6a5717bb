"""The expert layout of a mixture-of-experts plan, for the memo: the best plan of each expert-parallel
degree (why this EP), the share of the step the dispatch and combine all-to-alls take, and how the
choice moves with the load imbalance (Workload.moe_load_imbalance), the MoE term no run can fix before
it starts."""

from __future__ import annotations

import numpy as np

from service.design.decide import Scored, score
from service.plans.select import MEETS_BUDGET
from service.report.decision_records import ExpertFamily, ExpertParallelism, ImbalanceCase
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.production import GoodputSpec
from service.spec.workload import Budget, Workload

# Balanced routing (DeepSeek-V3's loss-free balancing measured ~1.04; NVIDIA's benchmarks force it), and
# twice the balanced share: the range a planner should see the choice hold over.
IMBALANCE_CASES = (1.0, 2.0)


def expert_parallelism(
    s: Scored,
    chosen: int | None,
    model: ModelSpec,
    workload: Workload,
    budget: Budget,
    params: ModelParams,
    goodput: GoodputSpec,
) -> ExpertParallelism | None:
    """The record for `chosen` (None for a dense model or without a choice)."""
    if model.moe is None or chosen is None:
        return None
    est, plans = s.est, s.plans
    share = np.where(est.step_time_s > 0, est.ep_comm_s / est.step_time_s, 0.0)
    host = np.where(est.step_time_s > 0, est.host_wait_s / est.step_time_s, 0.0)
    feasible = np.isin(s.selection.status, MEETS_BUDGET)
    value = s.regret_values(budget.objective)  # hours for cost: defined at a price of 0 too
    families = []
    for ep in np.unique(plans.ep[feasible]):
        rows = np.flatnonzero(feasible & (plans.ep == ep))
        best = int(rows[np.argmin(value[rows])])
        label = plans.row(best).short()
        families.append(ExpertFamily(ep=int(ep), label=label, tokens_per_s=float(est.tokens_per_s[best]),
                                     all_to_all_share=float(share[best]),
                                     host_wait_share=float(host[best])))  # fmt: skip
    # Fastest first under either objective: on one cluster the fastest plan is also the cheapest.
    families.sort(key=lambda f: -f.tokens_per_s)
    cases = []
    for imbalance in sorted({*IMBALANCE_CASES, workload.moe_load_imbalance}):
        w = workload.model_copy(update={"moe_load_imbalance": imbalance})
        other = score(model, s.cluster, w, budget, params, goodput, enumeration=s.enumeration)
        picked = other.selection.selected
        cases.append(
            ImbalanceCase(
                imbalance=imbalance,
                selected_label=plans.row(picked).short() if picked is not None else None,
                chosen_tokens_per_s=float(other.est.tokens_per_s[chosen]),
            )
        )
    plan = plans.row(chosen)
    return ExpertParallelism(
        ep=plan.ep,
        expert_tp=plan.expert_tp,
        all_to_all_share=float(share[chosen]),
        host_wait_share=float(host[chosen]),
        load_imbalance=workload.moe_load_imbalance,
        router=model.moe.router,
        families=families,
        imbalance=cases,
    )
