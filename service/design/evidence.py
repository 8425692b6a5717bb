"""What the memo prints beside the decision: the tie group the choice won, and the evidence behind
its number (the software stack, whether the fit saw it on this GPU, the nearest fitted runs and the
nearest published runs kept outside the fit)."""

from __future__ import annotations

import numpy as np

from service.calibrate.nearest import describe, describe_checks, nearest_checks, nearest_runs
from service.design.decide import Scored
from service.report.decision_records import Evidence, TieGroup
from service.spec.model import ModelSpec
from service.spec.moe_residuals import moe_residuals
from service.spec.params import ModelParams
from service.spec.stack import stack_names
from service.spec.workload import Workload


def tie_group(s: Scored) -> TieGroup | None:
    """The selection's tie group, or None when nothing ties the choice."""
    sel = s.selection
    if sel.selected is None or len(sel.ties) < 2:
        return None
    return TieGroup(
        resolution=sel.resolution,
        members=[s.plans.row(int(r)).short() for r in sel.ties],
        note=sel.tie_note,
    )


def evidence(
    s: Scored, row: int | None, params: ModelParams, model: ModelSpec, workload: Workload
) -> Evidence | None:
    """The chosen row's stack, the fitted runs nearest it, and the nearest published runs kept outside
    the fit (recent stacks, mixture-of-experts runs)."""
    if row is None or not params.runs:
        return None
    legacy = workload.zero3_collectives == "per_tensor_lists"
    stack = str(stack_names(s.plans.take(np.array([row])), legacy, model.moe is not None)[0])
    gpu = s.cluster.gpu.name
    widened = float(params.stack_widening([stack], gpu)[0]) if params.domain.stacks else 0.0
    note = (
        f"the fit never saw {stack} on {gpu}, so its interval is wider: +{widened:g} on the factor that "
        "scales the out-of-sample residual quantiles (an unseen stack can carry an offset no fitted source "
        "measured)"
        if widened
        else f"the fit saw {stack} on {gpu}"
    )
    moe = moe_residuals() if model.moe is not None else None
    if moe is not None:
        note += (
            f"; as a mixture of experts its interval is also at least as wide as the out-of-sample errors "
            f"of the {moe.n} published MoE runs, each scored leave-one-source-out (log residuals "
            f"q10 {moe.q10:+.2f}, q90 {moe.q90:+.2f})"
        )
    size_b, gpus = model.num_params / 1e9, s.cluster.num_gpus
    near = nearest_runs(params, stack, gpu, size_b, gpus)
    return Evidence(
        stack=stack,
        gpu=gpu,
        stack_fitted=not widened,
        interval_note=note,
        nearest=[describe(r) for r in near],
        outside_fit=[describe_checks(g) for g in nearest_checks(stack, gpu, size_b, gpus)],
    )
