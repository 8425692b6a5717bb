"""What the cost model returns: `EstimateTable` (numpy columns, one row per plan) and `Estimate`
(one plan, typed, with its memory and time breakdowns)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from pydantic import BaseModel, ConfigDict

from service.spec.params import ModelParams, ParamsSummary, Residuals
from service.spec.plan import Plan

MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead")
TIME_TERMS: tuple[str, ...] = ("compute", "recompute", "dp_comm", "tp_comm", "cp_comm", "pp_comm", "ep_comm")
TIME_TERMS += ("bubble", "offload", "host_wait", "overhead")


@dataclass(frozen=True)
class EstimateTable:
    """Per-plan numbers. Memory in bytes per GPU (the busier of the first and the last pipeline stage);
    times in seconds per optimizer step; the communication and offload terms are what is left after
    overlap, and all time terms add up to `step_time_s`."""

    params_bytes: np.ndarray
    grads_bytes: np.ndarray
    optimizer_bytes: np.ndarray
    activations_bytes: np.ndarray
    logits_bytes: np.ndarray
    buffers_bytes: np.ndarray
    overhead_bytes: np.ndarray
    total_bytes: np.ndarray
    cpu_offload_bytes: np.ndarray  # host memory per GPU holding offloaded states
    expert_states_bytes: np.ndarray  # of params + grads + optimizer: the routed experts' (MoE models)
    memory_limit_bytes: np.ndarray  # HBM × (1 − headroom)
    fits: np.ndarray
    compute_s: np.ndarray
    recompute_s: np.ndarray
    dp_comm_s: np.ndarray  # exposed (not hidden behind compute)
    tp_comm_s: np.ndarray
    cp_comm_s: np.ndarray  # exposed context-parallel all-to-alls / ring passes
    pp_comm_s: np.ndarray
    ep_comm_s: np.ndarray  # exposed MoE dispatch and combine all-to-alls
    bubble_s: np.ndarray
    offload_s: np.ndarray  # exposed
    host_wait_s: np.ndarray  # MoE block passes waiting for the host (compute.moe_host_floor_s)
    overhead_s: np.ndarray  # fixed framework time per step and micro-step (fitted; 0 a priori)
    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    tokens_per_s_per_gpu: np.ndarray
    model_tflops_per_gpu: np.ndarray
    mfu: np.ndarray
    hours: np.ndarray  # to train the workload's tokens
    dollars: np.ndarray
    # 80 % prediction interval from the parameter set's out-of-sample residuals (equal to the point
    # estimate when the set has none: the uncalibrated prior).
    tokens_per_s_low: np.ndarray
    tokens_per_s_high: np.ndarray
    hours_low: np.ndarray
    hours_high: np.ndarray
    dollars_low: np.ndarray
    dollars_high: np.ndarray
    params: ModelParams  # the parameter set every row was scored with
    moe_residuals: Residuals | None = None  # a MoE model's out-of-fit residuals, in its intervals

    def __len__(self) -> int:
        return len(self.total_bytes)

    def take(self, index: np.ndarray) -> EstimateTable:
        shared = ("params", "moe_residuals")
        cols = {f.name: getattr(self, f.name)[index] for f in fields(self) if f.name not in shared}
        return EstimateTable(**cols, params=self.params, moe_residuals=self.moe_residuals)


class MemoryBreakdown(BaseModel):
    """Bytes per GPU by term: `total` is the sum of params, grads, optimizer, activations, logits,
    buffers and overhead. `cpu_offload` is host memory, not in `total`; `experts` is the routed experts'
    share of params + grads + optimizer (already in them: do not add it again)."""

    model_config = ConfigDict(frozen=True)

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    overhead: float
    total: float
    cpu_offload: float
    experts: float = 0.0  # of params + grads + optimizer: the routed experts' states (MoE models)


class TimeBreakdown(BaseModel):
    """Seconds per optimizer step by term, after overlap; they add up to `step_time_s`."""

    model_config = ConfigDict(frozen=True)

    compute: float
    recompute: float
    dp_comm: float
    tp_comm: float
    cp_comm: float = 0.0
    pp_comm: float
    ep_comm: float = 0.0
    bubble: float
    offload: float
    host_wait: float = 0.0
    overhead: float = 0.0


class Estimate(BaseModel):
    """The cost model's answer for one plan."""

    model_config = ConfigDict(frozen=True)

    plan: Plan
    memory_per_gpu_bytes: MemoryBreakdown
    memory_limit_bytes: float
    fits: bool
    time_breakdown_s: TimeBreakdown
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    hours: float
    dollars: float
    tokens_per_s_interval: tuple[float, float]  # 80 %: (low, high)
    hours_interval: tuple[float, float]
    dollars_interval: tuple[float, float]
    params: ParamsSummary  # which parameter set, fit on what, how the interval was made

    @classmethod
    def from_table(cls, table: EstimateTable, plan: Plan, i: int = 0) -> Estimate:
        def g(name: str) -> float:
            return float(getattr(table, name)[i])

        memory = MemoryBreakdown(
            **{t: g(f"{t}_bytes") for t in MEMORY_TERMS},
            total=g("total_bytes"),
            cpu_offload=g("cpu_offload_bytes"),
            experts=g("expert_states_bytes"),
        )
        times = TimeBreakdown(**{t: g(f"{t}_s") for t in TIME_TERMS})
        return cls(
            plan=plan,
            memory_per_gpu_bytes=memory,
            memory_limit_bytes=g("memory_limit_bytes"),
            fits=bool(table.fits[i]),
            time_breakdown_s=times,
            step_time_s=g("step_time_s"),
            tokens_per_s=g("tokens_per_s"),
            tokens_per_s_per_gpu=g("tokens_per_s_per_gpu"),
            model_tflops_per_gpu=g("model_tflops_per_gpu"),
            mfu=g("mfu"),
            hours=g("hours"),
            dollars=g("dollars"),
            tokens_per_s_interval=(g("tokens_per_s_low"), g("tokens_per_s_high")),
            hours_interval=(g("hours_low"), g("hours_high")),
            dollars_interval=(g("dollars_low"), g("dollars_high")),
            params=table.params.summary(table.moe_residuals),
        )
