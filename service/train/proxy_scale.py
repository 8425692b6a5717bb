"""The production experiment scaled down to a proxy run, and the cost model's prediction for it.

A proxy keeps the plan's shape (dp, tp, pp, cp, ZeRO, offload, batch split, recompute) and the model's
architecture, with fewer layers (and optionally narrower) on `proxy.num_workers` devices, so that the
planner's prediction and the proxy's measurement describe the same run.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from service.spec.experiment import ExperimentSpec
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.param_bands import default_bands
from service.spec.params import ModelParams, load_params
from service.spec.plan import Plan
from service.spec.plan_checks import plan_problem
from service.spec.record import Metrics
from service.spec.workload import MAX_MOE_LOAD_IMBALANCE, Workload
from service.train.ds_config import PROXY_OVERLAP_COMM, proxy_precision

if TYPE_CHECKING:
    from service.costmodel.result import Estimate

# What `predict_proxy` answers: the worker's measured quantities of the same names, and whether it fits.
PREDICTED_QUANTITIES = (
    "tokens_per_s",
    "step_time_s",
    "model_state_bytes_per_rank",
    "activation_bytes_per_rank",
    "logits_bytes_per_rank",
    "peak_memory_bytes_per_rank",
    "fits",
)


def proxy_model(experiment: ExperimentSpec) -> ModelSpec:
    """The production model with `proxy.num_layers` layers, widths divided by `proxy.hidden_scale`."""
    proxy = experiment.proxy
    model = experiment.model.scaled(num_layers=proxy.num_layers, hidden_scale=proxy.hidden_scale)
    if proxy.vocab_size is not None:
        model = ModelSpec.model_validate({**model.model_dump(), "vocab_size": proxy.vocab_size})
    return model


def proxy_cluster(experiment: ExperimentSpec, num_workers: int | None = None) -> ClusterSpec:
    """One node of `num_workers` devices: the catalog's `cpu` on CPU proxies, else the production GPU."""
    workers = num_workers or experiment.proxy.num_workers
    gpu = "cpu" if experiment.proxy.device == "cpu" else experiment.cluster.gpu
    return ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=workers)  # type: ignore[arg-type]


def proxy_seq_len(experiment: ExperimentSpec) -> int:
    return experiment.proxy.seq_len or experiment.workload.seq_len


def proxy_workload(experiment: ExperimentSpec, plan: Plan, moe_load: float | None = None) -> Workload:
    """The proxy's step: `plan.micro_batch·grad_accum·dp` sequences of the proxy sequence length, its
    collectives overlapped as the proxies' DeepSpeed config runs them (`PROXY_OVERLAP_COMM`: off).

    A MoE proxy's experts are priced at `moe_load`, the load the proxy measured (`Metrics.moe_load`),
    when given: its router is untrained, and DeepSpeed's dropless path pads every expert to the busiest
    one's count (13.8× the balanced share on the Qwen3-30B-A3B proxy: 128 experts, top-8, 256 tokens a
    rank), far from a trained router's imbalance. Before a run, the experiment's `moe_load_imbalance`.
    Clipped to the field's range (a capacity router's padding is its capacity factor whatever the load:
    costmodel/moe.py `load_factor`)."""
    seq_len = proxy_seq_len(experiment)
    steps = experiment.proxy.steps
    imbalance = experiment.workload.moe_load_imbalance
    if moe_load is not None:
        imbalance = min(max(moe_load, 1.0), MAX_MOE_LOAD_IMBALANCE)
    return Workload(
        seq_len=seq_len,
        global_batch_sequences=plan.sequences_per_step,
        tokens_to_train=float(plan.sequences_per_step * seq_len * steps),
        overlap_comm=PROXY_OVERLAP_COMM,
        moe_load_imbalance=imbalance,
    )


def plan_for_point(experiment: ExperimentSpec, point: dict[str, Any], precision: str | None = None) -> Plan:
    """The proxy-scale plan of `point` (some `Plan` fields): dp fills the proxy's workers.

    Args:
        experiment: its `proxy.num_workers` sets dp = workers // (tp·pp·cp); a remainder is left for
            `proxy_plan_problem` to report.
        point: `Plan` fields other than dp (a search-space point, or the proxy-run flags).
        precision: the plan's precision (default: the proxy's, which is what a CPU proxy computes in).

    Raises `ValidationError` for combinations `Plan` itself rejects (e.g. offload_params with ZeRO-1).
    """
    tp, pp, cp = (int(point.get(k, 1)) for k in ("tp", "pp", "cp"))
    dp = max(1, experiment.proxy.num_workers // (tp * pp * cp))
    return Plan(**{**point, "dp": dp, "precision": precision or experiment.proxy.precision})


def proxy_plan(experiment: ExperimentSpec, plan: Plan) -> Plan:
    """`plan` with the precision the proxy actually computes in (see `ds_config.proxy_precision`)."""
    return plan.model_copy(update={"precision": proxy_precision(plan, experiment.proxy)})


def proxy_plan_problem(experiment: ExperimentSpec, plan: Plan) -> str | None:
    """Why `plan` cannot run at proxy scale (one line), or None. The rules are `plan_problem`'s (the
    deepspeed rule table already refuses shard groups: 0.19.8 removed MiCS), plus what the installed
    DeepSpeed cannot run on CPU: ZeRO++'s quantized weights and gradients (their quantizer op has no CPU
    implementation), and the layouts the MoE proxy does not build (`_moe_proxy_problem`)."""
    cluster = proxy_cluster(experiment, plan.num_gpus)
    if plan.num_gpus != experiment.proxy.num_workers:
        return f"dp·tp·pp = {plan.num_gpus} but the proxy has {experiment.proxy.num_workers} workers"
    problem = plan_problem(plan, proxy_model(experiment), cluster, proxy_workload(experiment, plan))
    if problem:
        return f"{problem[0]}: {problem[1]}"
    if experiment.model.mlp != "swiglu":
        return "model.mlp: the proxy is a Llama model (swiglu); gelu models have no proxy"
    if experiment.model.moe is not None:
        moe = _moe_proxy_problem(plan)
        if moe:
            return moe
    if experiment.proxy.device == "cpu" and (plan.zero_quantized_weights or plan.zero_quantized_gradients):
        return "zero_quantized_weights/gradients: DeepSpeed's quantizer op has no CPU implementation"
    return None


def _moe_proxy_problem(plan: Plan) -> str | None:
    """What the MoE proxy (service/train/moe.py) does not build: tensor-parallel layers around DeepSpeed's
    MoE layer (`tensor_parallel.apply_tensor_parallel` splits Llama MLPs, not a MoE block's shared
    experts, and the experts would need splitting for expert_tp = tp), nor Ulysses attention with it
    (its `UlyssesGroups` is not the `mpu` DeepSpeed's MoE groups are built from)."""
    for field, value in (("tp", plan.tp), ("cp", plan.cp)):
        if value > 1:
            return f"{field}: {value} with MoE blocks: the MoE proxy runs with {field} = 1 only; allowed: 1"
    return None


# The shipped set's per-step and per-micro-step overheads are fitted on published training frameworks
# at scale (data loading, logging, launch: tens of ms a step). A proxy runs our own worker loop,
# whose fixed costs differ: a tiny CPU proxy's whole ZeRO-0 step measured 62 ms (benchmarks/
# search_efficiency.py), less than that overhead alone. On an H200
# the 1-layer 13B-width proxy measured 0.087 s: 0.121 s predicted with the overhead, 0.058 s without
# (benchmarks/results/gpu_proxy_depth.json, before the meter's fix). So proxies are predicted with
# these two at their prior (0), and a run that calibrates on proxies of the production GPU fits them
# there (service/design/calibration.py).
FRAMEWORK_OVERHEADS = ("step_overhead_s", "microstep_overhead_s")


def proxy_params(params: ModelParams | None = None) -> ModelParams:
    """`params` (default: the shipped set) with the framework-overhead terms at their analytical prior."""
    if params is None:
        return _shipped_proxy_params()
    prior = default_bands()
    return params.with_values({k: prior[k].value for k in FRAMEWORK_OVERHEADS}, created=params.created)


@functools.cache
def _shipped_proxy_params() -> ModelParams:
    return proxy_params(load_params())


def predict_proxy(experiment: ExperimentSpec, plan: Plan, moe_load: float | None = None) -> Metrics:
    """The cost model's answer for the proxy run of `plan`, per rank: the busiest one (with a pipeline, the
    first or the last stage, whichever holds more), which is what the worker reports as measured. A MoE
    proxy's experts at `moe_load`, the load it measured, when given (see `proxy_workload`).

    Time uses `proxy_params()` (the framework overheads at their prior: see FRAMEWORK_OVERHEADS).
    Model state = params + grads + optimizer + cpu_offload (everything the rank holds for the model,
    wherever it lives: the measurement counts host and device alike); of it, a MoE model's routed experts'
    states (`expert_state_bytes_per_rank`). Activations = activations +
    logits (every tensor saved for backward, the loss's included). Peak = the estimate's total.
    """
    from service.costmodel import estimate

    est = estimate(
        proxy_model(experiment),
        proxy_cluster(experiment, plan.num_gpus),
        proxy_plan(experiment, plan),
        proxy_workload(experiment, plan, moe_load),
        memory_headroom=experiment.budget.memory_headroom,
        params=proxy_params(),
    )
    return per_rank_metrics(est)


def per_rank_metrics(est: Estimate) -> Metrics:
    """An estimate as the quantities a proxy worker measures per rank (see `predict_proxy`)."""
    mem = est.memory_per_gpu_bytes
    # A MoE model's routed experts' share of the model state, which the worker measures apart.
    experts = {"expert_state_bytes_per_rank": mem.experts} if mem.experts else {}
    return Metrics(
        tokens_per_s=est.tokens_per_s,
        step_time_s=est.step_time_s,
        model_state_bytes_per_rank=mem.params + mem.grads + mem.optimizer + mem.cpu_offload,
        activation_bytes_per_rank=mem.activations + mem.logits,
        logits_bytes_per_rank=mem.logits,
        peak_memory_bytes_per_rank=mem.total,
        fits=float(est.fits),
        **experts,
    )
