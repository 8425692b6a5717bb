"""Assembles the per-term formulas into memory, step time, tokens/s, MFU and cost for many plans at
once (`estimate_table`), or for one (`estimate`, the same code on a one-row table)."""

from __future__ import annotations

import numpy as np

from service.costmodel.flops import model_flops_per_token
from service.costmodel.result import Estimate, EstimateTable
from service.costmodel.step_memory import StageMemoryTerms, stage_memory_terms
from service.costmodel.step_time import peak_tflops, step_time_terms
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.moe_residuals import moe_residuals
from service.spec.params import ModelParams, interval_bounds, load_params
from service.spec.plan import Plan
from service.spec.plan_table import PlanTable
from service.spec.stack import plan_stacks
from service.spec.units import GIB
from service.spec.workload import Workload


def _rows_of(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """A length-`n` column holding `values` at `rows` and NaN elsewhere."""
    out = np.full(n, np.nan)
    out[rows] = values
    return out


def tokens_per_s_per_gpu(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, plans: PlanTable, params: ModelParams
) -> np.ndarray:
    """Each plan's tokens/s per GPU: `estimate_table`'s column without the memory terms and intervals
    around it (what a calibration fit evaluates for every run at every trial of its parameters)."""
    step = np.sum(list(step_time_terms(model, cluster, workload, plans, params).values()), axis=0)
    return _tokens_per_s(plans, workload, step) / cluster.num_gpus


def _tokens_per_s(plans: PlanTable, workload: Workload, step_time_s: np.ndarray) -> np.ndarray:
    """Tokens of a global batch over the step time."""
    return plans.micro_batch * plans.grad_accum * plans.dp * workload.seq_len / step_time_s


def estimate_table(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    plans: PlanTable,
    memory_headroom: float = 0.10,
    params: ModelParams | None = None,
    time_unfit: bool = True,
) -> EstimateTable:
    """Scores every plan in `plans` (assumed valid; see `service.spec.plan_checks.plan_problem`).

    `params`: the fitted parameter set (None = the shipped default, `load_params()`); its out-of-sample
    residuals give the 80 % interval columns (`tokens_per_s_low` … `dollars_high`).
    `time_unfit=False`: only the plans that fit in memory are timed; the others' time, throughput and
    cost columns are NaN (a ranking never reads them: a plan over memory loses on memory alone, and the
    time terms are most of the work on a large MoE plan space).
    """
    p = plans
    params = load_params() if params is None else params
    overhead = cluster.gpu.framework_overhead_gib * GIB
    first, last = stage_memory_terms(model, workload, p, params["activation_memory_scale"])
    use_last = last.total(overhead) > first.total(overhead)
    terms = StageMemoryTerms.__dataclass_fields__
    m = {f: np.where(use_last, getattr(last, f), getattr(first, f)) for f in terms}
    total = np.maximum(first.total(overhead), last.total(overhead))
    limit = np.full(len(p), cluster.gpu.hbm_gib * GIB * (1.0 - memory_headroom))
    fits = total <= limit

    timed = None if time_unfit or fits.all() else np.flatnonzero(fits)
    t = step_time_terms(model, cluster, workload, p if timed is None else p.take(timed), params)
    if timed is not None:
        t = {k: _rows_of(v, timed, len(p)) for k, v in t.items()}
    step = np.sum(list(t.values()), axis=0)
    tokens_per_s = _tokens_per_s(p, workload, step)
    per_gpu = tokens_per_s / cluster.num_gpus
    peak = peak_tflops(cluster.gpu, p.precision)  # fp8 plans: MFU against bf16 (GPUSpec.peak_tflops)
    model_tflops = per_gpu * model_flops_per_token(model, workload.seq_len) / 1e12
    hours = workload.tokens_to_train / tokens_per_s / 3600.0
    dollars_per_hour = cluster.num_gpus * cluster.price_usd_per_gpu_hour
    legacy = workload.zero3_collectives == "per_tensor_lists"
    stacks = plan_stacks(p, legacy, model.moe is not None) if params.domain.stacks else None
    moe = moe_residuals() if model.moe is not None else None
    low, high = interval_bounds(
        tokens_per_s, params, cluster.num_gpus, workload.seq_len, cluster.gpu.name, stacks, moe
    )
    hours_low, hours_high = workload.tokens_to_train / high / 3600.0, workload.tokens_to_train / low / 3600.0
    return EstimateTable(
        params_bytes=m["params"],
        grads_bytes=m["grads"],
        optimizer_bytes=m["optimizer"],
        activations_bytes=m["activations"],
        logits_bytes=m["logits"],
        buffers_bytes=m["buffers"],
        overhead_bytes=np.full(len(p), overhead),
        total_bytes=total,
        cpu_offload_bytes=m["cpu"],
        expert_states_bytes=m["experts"],
        memory_limit_bytes=limit,
        fits=fits,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=per_gpu,
        model_tflops_per_gpu=model_tflops,
        mfu=model_tflops / peak,
        hours=hours,
        dollars=hours * dollars_per_hour,
        tokens_per_s_low=low,
        tokens_per_s_high=high,
        hours_low=hours_low,
        hours_high=hours_high,
        dollars_low=hours_low * dollars_per_hour,
        dollars_high=hours_high * dollars_per_hour,
        params=params,
        moe_residuals=moe,
        **{f"{k}_s": v for k, v in t.items()},
    )


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: Plan,
    workload: Workload,
    memory_headroom: float = 0.10,
    params: ModelParams | None = None,
) -> Estimate:
    """The cost model's answer for one plan (validated first; bad plans raise `SpecError`).

    Example:
        >>> from service.catalog import load_model
        >>> e = estimate(load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4),
        ...              Plan(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="full"),
        ...              Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9))
        >>> e.fits
        True
    """
    from service.spec.plan_checks import check_plan

    check_plan(plan, model, cluster, workload)
    table = estimate_table(model, cluster, workload, PlanTable.from_plans([plan]), memory_headroom, params)
    return Estimate.from_table(table, plan)
