"""Seconds per optimizer step of a plan, term by term after overlap, for many plans at once: compute,
recompute, the data-, tensor-, context-, pipeline- and expert-parallel communication, the pipeline
bubble, offload, the MoE blocks' wait for the host and framework overhead (the slowest stage sets the
pace)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from service.costmodel import (
    comm,
    compute,
    context,
    data_parallel,
    expert_exchange,
    expert_sync,
    fp8,
    moe,
    offload,
    pipeline_parallel,
    tensor_parallel,
)
from service.costmodel import memory as mem
from service.costmodel import recompute as checkpointing
from service.costmodel.types import Num
from service.spec.hardware import ClusterSpec, GPUSpec
from service.spec.model import ModelSpec
from service.spec.params import ModelParams
from service.spec.plan_table import PlanTable
from service.spec.workload import Workload


def peak_tflops(gpu: GPUSpec, precision: np.ndarray) -> np.ndarray:
    """Per plan, the dense tensor-core peak of its precision (PRECISION_CODES order; fp8 → bf16)."""
    peaks = np.array([gpu.peak_tflops(name) for name in ("bf16", "fp16", "fp32", "fp8")])
    return np.asarray(peaks[np.asarray(precision, dtype=np.int64)], dtype=float)


def effective_gpu(gpu: GPUSpec, params: ModelParams) -> GPUSpec:
    """The catalog GPU with the fitted kernel-efficiency factors applied (capped at the peak).

    The fused attention rate (`fused_attention_efficiency`: cuDNN's kernel, FlashAttention-3) is kept as
    the catalog measured it, forward and backward together: the fitted attention factors describe the
    FlashAttention-2-era kernels the published runs at 2-8k tokens ran, where attention is a small share
    of the step and the factors absorb what else those runs spent. Scaled, the fused rate put
    long-sequence Megatron-Core runs (16k-128k tokens, attention most of the step) 9-32 % too slow, the
    error growing with the sequence; as measured they land within 4 % (benchmarks/moe_accuracy.py)."""
    return gpu.model_copy(
        update={
            "gemm_efficiency_max": min(1.0, gpu.gemm_efficiency_max * params["gemm_efficiency_scale"]),
            "fp8_gemm_efficiency_max": None
            if gpu.fp8_gemm_efficiency_max is None
            else min(1.0, gpu.fp8_gemm_efficiency_max * params["gemm_efficiency_scale"]),
            "attention_efficiency": min(1.0, gpu.attention_efficiency * params["attention_efficiency_scale"]),
        }
    )


def links(params: ModelParams) -> comm.Links:
    return comm.Links(
        intra_efficiency=params["intra_node_bus_efficiency"],
        inter_efficiency=params["inter_node_bus_efficiency"],
        latency_scale=params["collective_latency_scale"],
    )


def dense_mlp_share(model: ModelSpec) -> float:
    """The share of blocks with an MLP outside the routed experts: all of a dense model's; a MoE model's
    dense blocks and, where it has shared experts, its MoE blocks (whose routed copies costmodel/moe.py
    prices)."""
    moe_spec = model.moe
    if moe_spec is None:
        return 1.0
    moe_layers = model.num_moe_layers
    with_mlp = model.num_layers - moe_layers + (moe_layers if moe_spec.num_shared_experts else 0)
    return with_mlp / model.num_layers


def step_time_terms(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, p: PlanTable, params: ModelParams
) -> dict[str, np.ndarray]:
    """Seconds per optimizer step by term, after overlap (the slowest pipeline stage): `step_time`'s."""
    return step_time(model, cluster, workload, p, params).terms


@dataclass(frozen=True)
class StepTime:
    """A step's seconds by term, and the per-micro-batch pieces its all-to-all overlap was priced from
    (the arguments of expert_exchange.paired_exposed_s), for benchmarks that price other exchanges
    beside the same compute."""

    terms: dict[str, np.ndarray]
    ep_overlap: dict[str, Any]


def step_time(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, p: PlanTable, params: ModelParams
) -> StepTime:
    """Seconds per optimizer step by term, after overlap (the slowest pipeline stage). A MoE model's
    routed experts are priced by costmodel/moe.py, the rest of it as its dense view."""
    whole, model = model, model.dense_view()
    gpu, s = effective_gpu(cluster.gpu, params), workload.seq_len
    net = links(params)
    d = mem.activation_bytes_per_element(p.precision)
    peak = peak_tflops(gpu, p.precision) * 1e12  # bf16 for fp8 plans: only block GEMMs run in FP8
    gemm_peak, gemm_d = fp8.gemm_peak_flops(p.precision, gpu, peak), fp8.gemm_operand_bytes(p.precision, d)
    tokens = p.micro_batch * s / p.cp  # a context-parallel rank's share (costmodel/context.py)
    # The first stage holds the most blocks and sets the pace; the last holds the LM head (`head_share_s`).
    layers, last_layers = mem.stage_layers(model.num_layers, p.pp, p.virtual_stages)
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
    # attention_efficiency describes (same FLOPs, forward and backward). Its rate was measured over
    # forward and backward with backward at the FLOP ratio (ATTENTION_BACKWARD_RATIO; profile/derive.py),
    # so its backward takes that ratio, not the fitted one (see `effective_gpu`).
    fused_kernel = np.zeros(len(p), dtype=bool)
    if flash and gpu.fused_attention_efficiency is not None:
        speedup = gpu.fused_attention_efficiency / gpu.attention_efficiency
        fused_kernel = p.engine_column("transformer_engine") | workload.cudnn_attention
        attention_layer = attention_layer / np.where(fused_kernel, speedup, 1.0)
    backward_ratio = np.where(
        fused_kernel, compute.ATTENTION_BACKWARD_RATIO, params["attention_backward_ratio"] if flash else 2.0
    )
    attention = attention_layer * layers
    # Transformer Engine layers (Megatron-Core) fuse their element-wise ops whatever the workload says.
    fused = workload.fused_elementwise | p.engine_column("transformer_engine")
    elementwise = compute.elementwise_time_forward_s(model, tokens, p.tp, gpu, d, fused) * layers
    dynamic = p.engine_is("fp8_scaling", "dynamic")
    casts = fp8.cast_bytes_per_token_per_layer(model, p.tp, p.precision, dynamic, dense_mlp_share(whole))
    casts = tokens * casts * layers
    elementwise = elementwise + casts / (gpu.hbm_bandwidth_gb_per_s * 1e9)
    elementwise = params["elementwise_scale"] * elementwise
    head = compute.lm_head_time_forward_s(model, tokens, p.tp, gpu, peak, d)
    kernels = compute.KERNELS_PER_LAYER_FORWARD * layers
    moe_blocks = moe.moe_blocks_per_stage(whole, p.pp, p.virtual_stages)[2]  # the busiest stage's
    imbalance, scale = workload.moe_load_imbalance, params["elementwise_scale"]
    experts = moe.forward_s(whole, p, s, moe_blocks, gpu, gemm_peak, gemm_d, imbalance, scale)
    experts_a2a = expert_exchange.forward_s(
        whole, p, s, moe_blocks, cluster.gpus_per_node, gpu, net, imbalance,
        params["all_to_all_efficiency"], workload.moe_dispatcher,
    )  # fmt: skip
    blocks_fwd = gemm + attention + elementwise + experts
    fwd = blocks_fwd + head_share_s(head, blocks_fwd, layers, last_layers)
    fwd = np.maximum(fwd, compute.launch_bound_s(gpu, kernels))
    blocks_bwd = 2 * gemm + backward_ratio * attention
    blocks_bwd = blocks_bwd + compute.ELEMENTWISE_BACKWARD_RATIO * elementwise + 2 * experts
    bwd_work = blocks_bwd + head_share_s(2 * head, blocks_bwd, layers, last_layers)
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
        chosen = megatron_modules_recompute_s(
            whole, modules, p, s, gpu, gemm_peak, gemm_d, d, imbalance, tokens, layers,
            attention_block, gemm, experts, scale,
        )  # fmt: skip
        selective = np.where(megatron_modules, chosen, selective)
    recompute = np.select([p.recompute == 2, p.recompute == 1], [full_block, selective], 0.0)

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
    # micro-batch's compute, block by block (expert_exchange.paired_exposed_s).
    a2a = experts_a2a * (2 + ((p.recompute == 2) | (megatron_modules & ("moe" in modules))))
    per_block = np.maximum(moe_blocks, 1)
    pieces: dict[str, Any] = {
        "a2a_s": a2a, "exchange_s": experts_a2a / (2 * per_block),
        "attention_fwd_s": (blocks_fwd - experts) / layers,
        "attention_bwd_s": (blocks_bwd - 2 * experts) / layers,
        "experts_fwd_s": experts / per_block, "moe_blocks": moe_blocks,
        "paired_share": expert_exchange.overlap_paired_share(p.pp, p.virtual_stages, p.grad_accum),
        "contention": expert_exchange.overlap_contention(p, workload.moe_dispatcher, gpu, contention),
    }  # fmt: skip
    hidden_a2a = expert_exchange.paired_exposed_s(**pieces)
    ep_mb = np.where(p.ep_comm_overlap, hidden_a2a, a2a)
    slot = fwd + bwd + recompute + tp_mb + cp_mb + pp_mb + ep_mb
    # A MoE block pass waits for its host time where its GPU work is shorter (compute.moe_host_floor_s).
    graphs = p.engine_column("transformer_engine")  # Megatron-Core's TE capture
    # On the CPU stand-in the host does the work itself: its time is in the compute terms.
    host = 0.0 if gpu.is_cpu else 1.0
    per_expert = host * p.expert_rule_column("host_s_per_local_expert")
    local = whole.moe.num_experts / p.ep if whole.moe is not None else 0.0
    floor = compute.moe_host_floor_s(
        moe_blocks, host * params["moe_block_host_s"], per_expert, local, graphs, workload.cuda_graph_scope
    )
    host_wait = np.maximum(floor - slot, 0.0)
    slot = slot + host_wait
    # With fewer micro-batches than stages a chunk's round trip takes pp chunk slots of which only ga are
    # busy, so interleaving cuts nothing (torch's flex interleaved schedule runs such plans; Megatron
    # refuses them, service/spec/plan_checks.py): the plain 1F1B bubble.
    bubble = (p.pp - 1) / np.where(p.grad_accum >= p.pp, v, 1) * slot

    legacy_lists = workload.zero3_collectives == "per_tensor_lists"
    fp32_grads = workload.grad_reduce_in_fp32
    zero = data_parallel.zero_traffic(model, cluster, p, gpu, net, legacy_lists, whole, fp32_grads)
    # A MoE model's expert gradients reduce over their own group, in series with the dense ones in the
    # same windows; offload moves both slices' states, CPU Adam steps both.
    expert_traffic = expert_sync.traffic(whole, p, moe_blocks, gpn, gpu, net, fp32_grads)
    window = zero if expert_traffic is None else data_parallel.in_series(zero, expert_traffic)
    slices = [offload.dense_slice(model, p, zero.psi)]
    if expert_traffic is not None:
        slices.append(expert_sync.offload_slice(whole, p, moe_blocks))
    dp_comm = data_parallel.exposed_comm_s(window, p, fwd, bwd, contention)
    offload_s = data_parallel.exposed_offload_s(window, slices, p, fwd, bwd, gpu, contention)
    optimizer_step = data_parallel.optimizer_step_s(zero, p, gpu)
    optimizer_step = optimizer_step + expert_sync.optimizer_step_s(whole, p, moe_blocks, gpu)
    ga = p.grad_accum
    # Framework time the FLOP and byte counts miss (data loading, hooks, clipping, logging, launches
    # outside the layers): a fixed cost per step and per micro-step, fitted in ModelParams (0 a priori).
    overhead = params["step_overhead_s"] + ga * params["microstep_overhead_s"]
    terms = {
        "compute": ga * (fwd + bwd) + optimizer_step,
        "recompute": ga * recompute,
        "dp_comm": dp_comm,
        "tp_comm": ga * tp_mb,
        "cp_comm": ga * cp_mb,
        "pp_comm": ga * pp_mb,
        "ep_comm": ga * ep_mb,
        "bubble": bubble,
        "offload": offload_s,
        "host_wait": ga * host_wait,
        "overhead": np.asarray(overhead, dtype=float),
    }
    return StepTime(terms, pieces)


def head_share_s(head_s: Num, stage_blocks_s: Num, first_layers: Num, last_layers: Num) -> np.ndarray:
    """What the LM head adds to the busiest stage's pass: the pace is max(first stage's blocks, last stage's
    blocks + head). On an even split (and without a pipeline) the last stage is the first and the head adds
    in full. Where the blocks do not divide, the split gives the first stages the extra blocks
    (`memory.stage_layers`) and the head runs in the time the last stage's fewer blocks leave: NVIDIA's
    recipes for uneven depths (Llama 3.1 405B's 126 blocks, Qwen3-235B's 94) count embedding and loss as
    a block each in Megatron's split (`account_for_embedding_in_pipeline_split`,
    `account_for_loss_in_pipeline_split`, Megatron-Bridge recipes/llama/h100/llama3.py and
    recipes/qwen/h100/qwen3_moe.py), which leaves the last stage one block short for its head, as here."""
    block_s = np.asarray(stage_blocks_s) / np.asarray(first_layers)
    spare_s = (np.asarray(first_layers) - np.asarray(last_layers)) * block_s
    return np.asarray(np.maximum(np.asarray(head_s) - spare_s, 0.0), dtype=float)


def megatron_modules_recompute_s(
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
    elementwise_scale: float,
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
        # The activation made again, and in FP8 fc2's input cast again for its weight-gradient GEMM.
        again = moe.activation_time_forward_s(whole, p, seq_len, gpu, d, load)
        again = again + moe.fp8_cast_time_forward_s(whole, p, seq_len, gpu, load, fc1=False)
        expert_activation = elementwise_scale * again * blocks
    mlp_gemm = gemm - attention_gemm
    chosen = checkpointing.megatron_modules_recompute_s(
        whole, modules, attention_block, up * layers, mlp_gemm, norms, experts, expert_activation
    )
    return np.asarray(chosen, dtype=float)
