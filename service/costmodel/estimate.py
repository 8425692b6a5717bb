"""Assembles the per-term formulas into memory, step time, tokens/s, MFU and cost for many plans at
once (`estimate_table`), or for one (`estimate`, the same code on a one-row table)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel import (
    comm,
    compute,
    context,
    data_parallel,
    fp8,
    moe,
    pipeline_parallel,
    tensor_parallel,
)
from service.costmodel import hierarchical_zero as hz
from service.costmodel import memory as mem
from service.costmodel import recompute as checkpointing
from service.costmodel.flops import model_flops_per_token
from service.costmodel.result import Estimate, EstimateTable
from service.costmodel.types import Num
from service.spec.hardware import ClusterSpec, GPUSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams, interval_bounds, load_params
from service.spec.plan import Plan
from service.spec.plan_table import PlanTable
from service.spec.stack import plan_stacks
from service.spec.units import GIB
from service.spec.workload import Workload


@dataclass(frozen=True)
class _Memory:
    """One pipeline stage's memory terms (bytes per GPU)."""

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    logits: np.ndarray
    buffers: np.ndarray
    cpu: np.ndarray
    experts: np.ndarray  # of params + grads + optimizer: the routed experts' states (MoE models)

    def total(self, overhead: float) -> np.ndarray:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.activations
            + self.logits
            + self.buffers
            + overhead
        )


def _model_states(model: ModelSpec, p: PlanTable, psi: np.ndarray) -> tuple[np.ndarray, ...]:
    """(params, grads, optimizer) on the GPU and bytes moved to the host, for Ψ = `psi` params."""
    pb, gb, ob = mem.state_bytes_per_param(p.precision, p.zero_stage)
    shards = hz.shard_ranks(p)  # dp·cp ranks, or the plan's shard group (costmodel/hierarchical_zero.py)
    params, grads, optimizer = mem.zero_sharded_bytes(psi, shards, p.zero_stage, pb, gb, ob)
    persistent = mem.zero3_persistent_params(model, p.tp, p.pp, p.virtual_stages)
    params = np.where(p.zero_stage == 3, pb * (persistent + (psi - persistent) / shards), params)
    params = params + hz.hpz_secondary_bytes(psi - persistent, pb, p.zero_hpz_partition_size)
    # ZeRO-Offload keeps optimizer states (and, from stage 2, the fp32 gradient partition) on the host;
    # ZeRO-Infinity parameter offload keeps the partitioned parameters there (Ren et al. 2021, §4).
    # Stage 2 accumulates gradients straight into the host buffer; stage 3 also keeps its device-side
    # flat gradient partition (stage3.py `grad_partitions_flat_buffer`; measured on the proxy).
    cpu = np.where(p.offload_optimizer, optimizer, 0.0)
    cpu = cpu + np.where(p.offload_optimizer & (p.zero_stage >= 2), 4.0 * psi / shards, 0.0)
    cpu = cpu + np.where(p.offload_params, params - pb * persistent, 0.0)
    optimizer = np.where(p.offload_optimizer, 0.0, optimizer)
    grads = np.where(p.offload_optimizer & (p.zero_stage == 2), 0.0, grads)
    params = np.where(p.offload_params, pb * persistent, params)
    return params, grads, optimizer, cpu


def _memory(
    model: ModelSpec, workload: Workload, p: PlanTable, activation_scale: float = 1.0
) -> tuple[_Memory, _Memory]:
    """Memory of the first and of the last pipeline stage (the same stage when pp = 1). A MoE model's
    routed experts are priced by costmodel/moe.py, the rest of it as its dense view."""
    load = moe.load_factor(model, p, workload.moe_load_imbalance)
    whole, model = model, model.dense_view()
    d = mem.activation_bytes_per_element(p.precision)
    tokens = p.micro_batch * workload.seq_len / p.cp  # a context-parallel rank's share of the sequence
    first_layers, last_layers = mem.stage_layers(model.num_layers, p.pp, p.virtual_stages)
    s = workload.seq_len
    flash = workload.flash_attention
    te = p.engine_column("transformer_engine")  # Megatron-Core builds its blocks from TE modules
    per_layer = mem.activation_bytes_per_token_per_layer(
        model, p.tp, p.sequence_parallel, p.recompute, d, s, flash, p.precision, te
    )
    recompute_peak = tokens * mem.recompute_peak_bytes_per_token(
        model, p.tp, p.sequence_parallel, p.recompute, d, s, flash, p.precision, te
    )
    if workload.selective_recompute != "attention_block":
        # Other frameworks' selective policies (Workload.selective_recompute) keep other tensors, and make a
        # whole block's again in backward, as full recompute does.
        block = mem.recompute_peak_bytes_per_token(
            model, p.tp, p.sequence_parallel, np.full_like(p.recompute, 2), d, s, flash, p.precision, te
        )
        full = mem.activation_bytes_per_token_per_layer(
            model, p.tp, p.sequence_parallel, np.full_like(p.recompute, 2), d, s, flash, p.precision, te
        )
        kind = workload.selective_recompute
        selective = checkpointing.selective_bytes_per_token_per_layer(
            model, p.tp, p.sequence_parallel, d, kind, per_layer, block, full
        )
        per_layer = np.where(p.recompute == 1, selective, per_layer)
        recompute_peak = np.where(p.recompute == 1, tokens * block, recompute_peak)
    modules = workload.recompute_modules
    if set(modules) != {"core_attn"}:  # Megatron-Core's fine-grained selective recompute (megatron plans)
        g = moe.saved_gemm_input_bytes(p, d)
        delta = checkpointing.megatron_modules_bytes_per_token_per_layer(
            whole, modules, p.tp, p.sequence_parallel, d, g
        )
        per_layer = per_layer + np.where(te & (p.recompute == 1), delta, 0.0)
    # Ulysses' extra saved tensors belong to the attention sub-block: selective and full recompute do
    # not keep them; full recompute re-creates them with the block in backward.
    ulysses = context.ulysses_saved_bytes_per_token_per_layer(model, p.tp, p.cp, p.engine, d)
    per_layer = per_layer + np.where(p.recompute == 0, ulysses, 0.0)
    recompute_peak = recompute_peak + tokens * np.where(p.recompute == 2, ulysses, 0.0)
    in_flight = mem.micro_batches_in_flight(p.pp, p.grad_accum, p.virtual_stages)
    pipe_buffers = np.where(p.pp > 1, 2.0 * in_flight * tokens * model.hidden_size * d, 0.0)
    vocab_split = mem.vocab_parallel(p.engine)
    logits_per_token = mem.logits_bytes_per_token(model, d, s, p.tp, p.sequence_parallel, vocab_split)
    pb, _, _ = mem.state_bytes_per_param(p.precision, p.zero_stage)
    first_psi, last_psi = mem.stage_params_per_gpu(model, p.tp, p.pp, p.virtual_stages, vocab_split)
    first_moe, last_moe, _ = moe.moe_blocks_per_stage(whole, p.pp, p.virtual_stages)
    if whole.moe is not None:  # the dense view's mean MLP, corrected to the blocks each stage holds
        first_psi = first_psi + moe.dense_mlp_excess_per_gpu(whole, first_layers, first_moe, p.tp)
        last_psi = last_psi + moe.dense_mlp_excess_per_gpu(whole, last_layers, last_moe, p.tp)
    # DeepSpeed's ZeRO buckets; FSDP's gather/reduce buffers are priced the same. Megatron's distributed
    # optimizer reduces and gathers in place in its contiguous grad and param buffers (Megatron-Core
    # `distributed/param_and_grad_buffer.py`), which the grads and params terms already count; its
    # Megatron-FSDP (zero_stage 2-3) is priced the same way, without a separate gather buffer.
    buckets = np.where(p.engine_column("gather_buffers"), 1.0, 0.0)
    stages = []
    first = (first_psi, first_layers, first_moe, in_flight, p.pp == 1)
    for psi, layers, moe_blocks, micro_batches, is_last in (
        first,
        (last_psi, last_layers, last_moe, 1, True),
    ):
        params, grads, optimizer, cpu = _model_states(model, p, psi)
        logits = np.where(is_last, tokens * logits_per_token, 0.0)
        transient = tokens * mem.logits_transient_bytes_per_token(model, d, p.tp, vocab_split)
        transient = np.where(is_last, transient, 0.0)
        buffers = buckets * pb * mem.zero_buffer_elements(model, p.zero_stage, psi) + pipe_buffers + transient
        buffers = buffers + context.buffer_bytes(model, tokens, p.tp, p.cp, p.engine, d)
        matmul = (model.attention_params_per_layer + model.mlp_params_per_layer) / p.tp * layers
        matmul = matmul / np.where(p.zero_stage == 3, hz.shard_ranks(p), 1)
        buffers = buffers + fp8.extra_memory_bytes(matmul, layers, p.precision)
        # ZeRO-1/2 with optimizer offload stages each gradient through a device buffer the size of the
        # largest parameter, the embedding (stage_1_and_2.py `temp_grad_buffer_for_gpu_offload`).
        offload_staging = p.offload_optimizer & (p.zero_stage >= 1) & (p.zero_stage <= 2)
        buffers = buffers + np.where(offload_staging, pb * model.vocab_size * model.hidden_size, 0.0)
        state_bytes = mem.state_bytes_per_param(p.precision, p.zero_stage)
        x = moe.stage_memory(
            whole, p, workload.seq_len, moe_blocks, micro_batches, d, load, state_bytes, modules
        )
        params, grads, optimizer, cpu = (
            params + x.params,
            grads + x.grads,
            optimizer + x.optimizer,
            cpu + x.host,
        )
        buffers = buffers + x.buffers
        # A fully recomputed block is rebuilt in backward only after the loss has freed its tensors, so
        # the peak holds one of the two, not both (measured on the proxy, tests/train).
        peak = np.maximum(recompute_peak + x.recompute_peak - logits, 0.0)
        activations = tokens * per_layer * layers * micro_batches + x.saved + peak
        activations = activation_scale * activations
        experts = x.params + x.grads + x.optimizer
        stages.append(_Memory(params, grads, optimizer, activations, logits, buffers, cpu, experts))
    return stages[0], stages[1]


def _peak_tflops(gpu: GPUSpec, precision: np.ndarray) -> np.ndarray:
    """Per plan, the dense tensor-core peak of its precision (PRECISION_CODES order; fp8 → bf16)."""
    peaks = np.array([gpu.peak_tflops(name) for name in ("bf16", "fp16", "fp32", "fp8")])
    return np.asarray(peaks[np.asarray(precision, dtype=np.int64)], dtype=float)


def effective_gpu(gpu: GPUSpec, params: ModelParams) -> GPUSpec:
    """The catalog GPU with the fitted kernel-efficiency factors applied (capped at the peak)."""
    return gpu.model_copy(
        update={
            "gemm_efficiency_max": min(1.0, gpu.gemm_efficiency_max * params["gemm_efficiency_scale"]),
            "fp8_gemm_efficiency_max": None
            if gpu.fp8_gemm_efficiency_max is None
            else min(1.0, gpu.fp8_gemm_efficiency_max * params["gemm_efficiency_scale"]),
            "attention_efficiency": min(1.0, gpu.attention_efficiency * params["attention_efficiency_scale"]),
            "fused_attention_efficiency": None
            if gpu.fused_attention_efficiency is None
            else min(1.0, gpu.fused_attention_efficiency * params["attention_efficiency_scale"]),
        }
    )


def links(params: ModelParams) -> comm.Links:
    return comm.Links(
        intra_efficiency=params["intra_node_bus_efficiency"],
        inter_efficiency=params["inter_node_bus_efficiency"],
        latency_scale=params["collective_latency_scale"],
    )


def _times(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, p: PlanTable, params: ModelParams
) -> dict[str, np.ndarray]:
    """Seconds per optimizer step by term, after overlap (the slowest pipeline stage). A MoE model's
    routed experts are priced by costmodel/moe.py, the rest of it as its dense view."""
    whole, model = model, model.dense_view()
    gpu, s = effective_gpu(cluster.gpu, params), workload.seq_len
    net = links(params)
    d = mem.activation_bytes_per_element(p.precision)
    peak = _peak_tflops(gpu, p.precision) * 1e12  # bf16 for fp8 plans: only block GEMMs run in FP8
    gemm_peak, gemm_d = fp8.gemm_peak_flops(p.precision, gpu, peak), fp8.gemm_operand_bytes(p.precision, d)
    tokens = p.micro_batch * s / p.cp  # a context-parallel rank's share (costmodel/context.py)
    layers = mem.stage_layers(model.num_layers, p.pp, p.virtual_stages)[0]  # the busiest stage sets the pace
    # Transformer Engine stacks on Hopper-class GPUs (those whose catalog entry has cuDNN's fused
    # attention) sustain their own share of the GEMM rate: `te_gemm_scale`, fitted on NVIDIA's TE recipes.
    te_hopper = p.engine_column("transformer_engine") & (gpu.fused_attention_efficiency is not None)
    gemm_peak = gemm_peak * np.where(te_hopper, params["te_gemm_scale"], 1.0)
    gemm = compute.layer_gemm_time_forward_s(model, tokens, p.tp, gpu, gemm_peak, gemm_d) * layers
    flash = workload.flash_attention
    ring = context.is_ring(p.engine)
    # Ring attention runs the kernel on chunks of s/cp keys; Ulysses on whole sequences (of fewer heads).
    kernel_seq = np.where(ring, s / p.cp, s)
    attention_layer = compute.attention_time_forward_s(
        model, tokens, s, p.tp, gpu, peak, d, flash, kernel_seq
    )
    # Megatron-Core runs Transformer Engine's attention, cuDNN's fused kernel, and so does torch's SDPA
    # from torch 2.11 (Workload.cudnn_attention): on Hopper faster than the FlashAttention-2 the catalog's
    # attention_efficiency describes (same FLOPs, forward and backward).
    if flash and gpu.fused_attention_efficiency is not None:
        speedup = gpu.fused_attention_efficiency / gpu.attention_efficiency
        cudnn = p.engine_column("transformer_engine") | workload.cudnn_attention
        attention_layer = attention_layer / np.where(cudnn, speedup, 1.0)
    attention = attention_layer * layers
    # Transformer Engine layers (Megatron-Core) fuse their element-wise ops whatever the workload says.
    fused = workload.fused_elementwise | p.engine_column("transformer_engine")
    elementwise = compute.elementwise_time_forward_s(model, tokens, p.tp, gpu, d, fused) * layers
    dynamic = p.engine_is("fp8_scaling", "dynamic")
    casts = tokens * fp8.cast_bytes_per_token_per_layer(model, p.tp, p.precision, dynamic) * layers
    elementwise = elementwise + casts / (gpu.hbm_bandwidth_gb_per_s * 1e9)
    elementwise = params["elementwise_scale"] * elementwise
    head = compute.lm_head_time_forward_s(model, tokens, p.tp, gpu, peak, d)
    kernels = compute.KERNELS_PER_LAYER_FORWARD * layers
    moe_blocks = moe.moe_blocks_per_stage(whole, p.pp, p.virtual_stages)[2]  # the busiest stage's
    experts, experts_a2a = moe.forward_s(
        whole, p, s, moe_blocks, cluster.gpus_per_node, gpu, gemm_peak, gemm_d, net,
        workload.moe_load_imbalance, params["all_to_all_efficiency"], workload.moe_dispatcher,
    )  # fmt: skip
    fwd = np.maximum(gemm + attention + elementwise + head + experts, compute.launch_bound_s(gpu, kernels))
    bwd_work = 2 * gemm + (params["attention_backward_ratio"] if flash else 2.0) * attention
    bwd_work = bwd_work + compute.ELEMENTWISE_BACKWARD_RATIO * elementwise + 2 * head + 2 * experts
    bwd = np.maximum(bwd_work, compute.launch_bound_s(gpu, 2 * kernels))
    # Selective recompute re-runs each block's attention sub-block (projections and attention core), as
    # this service's worker checkpoints it. Megatron checkpoints the core alone; pricing that instead was
    # tried twice and worsened the cross-validated error both times (benchmarks/README.md), so Megatron's
    # selective recompute keeps the projections' forward here too (a few per cent slower than it runs).
    attention_block = (
        compute.attention_gemm_time_forward_s(model, tokens, p.tp, gpu, gemm_peak, gemm_d) * layers
        + attention
    )
    full_block = gemm + attention + elementwise + experts
    selective = checkpointing.selective_recompute_s(
        model, workload.selective_recompute, attention_block, full_block, gemm, elementwise
    )
    modules = workload.recompute_modules
    # Megatron-Core's fine-grained selective recompute (Workload.recompute_modules)
    fine_grained = set(modules) != {"core_attn"}
    megatron_modules = p.engine_column("transformer_engine") & (p.recompute == 1) & fine_grained
    if np.any(megatron_modules):
        chosen = _megatron_modules_recompute_s(
            whole, modules, p, s, gpu, gemm_peak, gemm_d, d, workload.moe_load_imbalance, tokens, layers,
            attention_block, gemm, experts,
        )  # fmt: skip
        selective = np.where(megatron_modules, chosen, selective)
    recompute = np.select([p.recompute == 2, p.recompute == 1], [full_block, selective], 0.0)

    backward_ratio = params["attention_backward_ratio"]
    gpn = cluster.gpus_per_node
    cp_mb = context.exposed_per_layer_s(model, p, tokens, d, attention_layer, backward_ratio, gpn, gpu, net)
    cp_mb = cp_mb * layers
    # Without overlap (overlap_comm off) a collective costs its whole time: contention 1.
    contention = params["overlap_contention"] if workload.overlap_comm else 1.0
    tp_ar = comm.all_reduce_time_s(
        tokens * model.hidden_size * d, p.tp, 1, cluster.gpus_per_node, gpu, links=net
    )
    tp_mb = tensor_parallel.tp_comm_per_micro_batch_s(model, p, tp_ar, gemm / layers, contention) * layers

    # Pipeline: activations forward and their gradients backward across each stage boundary, and the
    # 1F1B bubble of (pp − 1) micro-batch slots (Narayanan et al. 2021, §2.2). The interleaved schedule
    # with v model chunks per stage cuts the bubble to (pp − 1)/v slots (the slot's chunk compute is 1/v
    # of the stage's, so the bubble is (pp − 1)/v · slot).
    v = p.virtual_stages
    pp_mb = pipeline_parallel.pp_comm_per_micro_batch_s(
        cluster, p, tokens * model.hidden_size * d, gpu, net, fwd + bwd, contention
    )
    # The dispatch and combine all-to-alls run forward, backward and in a fully recomputed forward;
    # Megatron-Core's 1F1B all-to-all overlap (Plan.ep_comm_overlap) hides them behind another
    # micro-batch's forward and backward, as the other overlapped collectives hide.
    a2a = experts_a2a * (2 + ((p.recompute == 2) | (megatron_modules & ("moe" in modules))))
    ep_mb = np.where(p.ep_comm_overlap, comm.overlapped_exposed_s(a2a, fwd + bwd, contention), a2a)
    slot = fwd + bwd + recompute + tp_mb + cp_mb + pp_mb + ep_mb
    bubble = (p.pp - 1) / v * slot

    dp_comm, offload, optimizer_step = data_parallel.comm_offload_and_optimizer_s(
        model, cluster, p, fwd, bwd, gpu, net, contention, workload.zero3_collectives == "per_tensor_lists"
    )
    ga = p.grad_accum
    overlapped = workload.overlap_comm | p.comm_overlap
    expert_dp, expert_step = moe.data_parallel_s(
        whole, p, moe_blocks, cluster.gpus_per_node, gpu, net, ga * bwd, overlapped, contention
    )
    dp_comm, optimizer_step = dp_comm + expert_dp, optimizer_step + expert_step
    # Framework time the FLOP and byte counts miss (data loading, hooks, clipping, logging, launches
    # outside the layers): a fixed cost per step and per micro-step, fitted in ModelParams (0 a priori).
    overhead = params["step_overhead_s"] + ga * params["microstep_overhead_s"]
    return {
        "compute": ga * (fwd + bwd) + optimizer_step,
        "recompute": ga * recompute,
        "dp_comm": dp_comm,
        "tp_comm": ga * tp_mb,
        "cp_comm": ga * cp_mb,
        "pp_comm": ga * pp_mb,
        "ep_comm": ga * ep_mb,
        "bubble": bubble,
        "offload": offload,
        "overhead": np.asarray(overhead, dtype=float),
    }


def _megatron_modules_recompute_s(
    whole: ModelSpec,
    modules: tuple[str, ...],
    p: PlanTable,
    seq_len: int,
    gpu: GPUSpec,
    gemm_peak: Num,
    gemm_d: Num,
    d: Num,
    imbalance: float,
    tokens: np.ndarray,
    layers: np.ndarray,
    attention_block: np.ndarray,
    gemm: np.ndarray,
    experts: np.ndarray,
) -> np.ndarray:
    """A stage's forward work that `modules` re-run in backward (recompute.megatron_modules_recompute_s),
    from the stage's forward times and the modules' own pieces."""
    model = whole.dense_view()
    attention_gemm = compute.attention_gemm_time_forward_s(model, tokens, p.tp, gpu, gemm_peak, gemm_d)
    attention_gemm = attention_gemm * layers
    up = sum(
        (
            compute.gemm_time_s(tokens, proj.out_features / p.tp, proj.in_features, gpu, gemm_peak, gemm_d)
            for proj in model.attention_projections
            if proj.name in ("q_b_proj", "kv_b_proj")
        ),
        np.zeros(len(p)),
    )
    g = moe.saved_gemm_input_bytes(p, d)
    split = np.where(p.sequence_parallel, p.tp, 1)
    norms = tokens * 2 * (d + g) * model.hidden_size / split / (gpu.hbm_bandwidth_gb_per_s * 1e9) * layers
    expert_activation = np.zeros(len(p))
    if whole.moe is not None:
        blocks = moe.moe_blocks_per_stage(whole, p.pp, p.virtual_stages)[2]
        load = moe.load_factor(whole, p, imbalance)
        expert_activation = moe.activation_recompute_time_forward_s(whole, p, seq_len, gpu, d, load) * blocks
    mlp_gemm = gemm - attention_gemm
    chosen = checkpointing.megatron_modules_recompute_s(
        whole, modules, attention_block, up * layers, mlp_gemm, norms, experts, expert_activation
    )
    return np.asarray(chosen, dtype=float)


def _rows_of(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """A length-`n` column holding `values` at `rows` and NaN elsewhere."""
    out = np.full(n, np.nan)
    out[rows] = values
    return out


def estimate_table(
    model: ModelSpec,
    cluster: ClusterSpec,
    workload: Workload,
    plans: PlanTable,
    memory_headroom: float = 0.10,
    params: ModelParams | None = None,
    time_unfit: bool = True,
) -> EstimateTable:
    """Scores every plan in `plans` (assumed valid; see `service.spec.plan.plan_problem`).

    `params`: the fitted parameter set (None = the shipped default, `load_params()`); its out-of-sample
    residuals give the 80 % interval columns (`tokens_per_s_low` … `dollars_high`).
    `time_unfit=False`: only the plans that fit in memory are timed; the others' time, throughput and
    cost columns are NaN (a ranking never reads them: a plan over memory loses on memory alone, and the
    time terms are most of the work on a large MoE plan space).
    """
    p = plans
    params = load_params() if params is None else params
    overhead = cluster.gpu.framework_overhead_gib * GIB
    first, last = _memory(model, workload, p, params["activation_memory_scale"])
    use_last = last.total(overhead) > first.total(overhead)
    m = {f: np.where(use_last, getattr(last, f), getattr(first, f)) for f in _Memory.__dataclass_fields__}
    total = np.maximum(first.total(overhead), last.total(overhead))
    limit = np.full(len(p), cluster.gpu.hbm_gib * GIB * (1.0 - memory_headroom))
    fits = total <= limit

    timed = None if time_unfit or fits.all() else np.flatnonzero(fits)
    t = _times(model, cluster, workload, p if timed is None else p.take(timed), params)
    if timed is not None:
        t = {k: _rows_of(v, timed, len(p)) for k, v in t.items()}
    step = np.sum(list(t.values()), axis=0)
    tokens_per_s = p.micro_batch * p.grad_accum * p.dp * workload.seq_len / step
    per_gpu = tokens_per_s / cluster.num_gpus
    peak = _peak_tflops(cluster.gpu, p.precision)  # fp8 plans: MFU against bf16 (GPUSpec.peak_tflops)
    model_tflops = per_gpu * model_flops_per_token(model, workload.seq_len) / 1e12
    hours = workload.tokens_to_train / tokens_per_s / 3600.0
    dollars_per_hour = cluster.num_gpus * cluster.price_usd_per_gpu_hour
    legacy = workload.zero3_collectives == "per_tensor_lists"
    stacks = plan_stacks(p, legacy, model.moe is not None) if params.domain.stacks else None
    low, high = interval_bounds(
        tokens_per_s, params, cluster.num_gpus, workload.seq_len, cluster.gpu.name, stacks
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
    from service.spec.plan import check_plan

    check_plan(plan, model, cluster, workload)
    table = estimate_table(model, cluster, workload, PlanTable.from_plans([plan]), memory_headroom, params)
    return Estimate.from_table(table, plan)
