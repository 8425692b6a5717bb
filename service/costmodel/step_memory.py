"""Memory per GPU of a plan's first and last pipeline stage, term by term (bytes), for many plans at
once: model states after ZeRO and offload, activations by recompute policy and schedule, logits,
buffers, and the MoE terms of costmodel/moe.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel import (
    context,
    fp8,
    moe,
)
from service.costmodel import hierarchical_zero as hz
from service.costmodel import memory as mem
from service.costmodel import recompute as checkpointing
from service.costmodel.types import Num, on_distinct
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable
from service.spec.workload import Workload


@dataclass(frozen=True)
class StageMemoryTerms:
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


def model_states(
    model: ModelSpec, p: PlanTable, psi: np.ndarray, fp32_grads: bool = False
) -> tuple[np.ndarray, ...]:
    """(params, grads, optimizer) on the GPU and bytes moved to the host, for Ψ = `psi` params
    (`fp32_grads`: Workload.grad_reduce_in_fp32)."""
    pb, gb, ob = mem.plan_state_bytes(p, fp32_grads)
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


def stage_memory_terms(
    model: ModelSpec, workload: Workload, p: PlanTable, activation_scale: float = 1.0
) -> tuple[StageMemoryTerms, StageMemoryTerms]:
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

    def saved_per_token(view: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
        """(bytes saved per token and block, bytes one recomputed block holds per token) of `view`'s
        blocks, by recompute policy."""

        def per_token(tp: Num, sp: Num, recompute: Num, precision: Num, te_: Num) -> tuple[Num, Num]:
            # Functions of these five columns alone: a few dozen combinations among millions of plans.
            sp, te_ = np.asarray(sp, dtype=bool), np.asarray(te_, dtype=bool)
            d_ = mem.activation_bytes_per_element(precision)
            args = (view, tp, sp, recompute, d_, s, flash, precision, te_)
            return mem.activation_bytes_per_token_per_layer(*args), mem.recompute_peak_bytes_per_token(*args)

        per_layer, peak = on_distinct(per_token, p.tp, p.sequence_parallel, p.recompute, p.precision, te)
        if workload.selective_recompute != "attention_block":
            # Other frameworks' selective policies (Workload.selective_recompute) keep other tensors, and
            # make a whole block's again in backward, as full recompute does.
            full_policy = np.full_like(p.recompute, 2)
            block = mem.recompute_peak_bytes_per_token(
                view, p.tp, p.sequence_parallel, full_policy, d, s, flash, p.precision, te
            )
            full = mem.activation_bytes_per_token_per_layer(
                view, p.tp, p.sequence_parallel, full_policy, d, s, flash, p.precision, te
            )
            kind = workload.selective_recompute
            selective = checkpointing.selective_bytes_per_token_per_layer(
                view, p.tp, p.sequence_parallel, d, kind, per_layer, block, full
            )
            per_layer = np.where(p.recompute == 1, selective, per_layer)
            peak = np.where(p.recompute == 1, block, peak)
        return np.asarray(per_layer, dtype=float), np.asarray(peak, dtype=float)

    # The dense view's blocks all carry its mean MLP; a MoE model's dense blocks (DeepSeek's first three,
    # 18,432 wide) and its MoE blocks (shared experts and router) save what their own widths make, and a
    # stage holds its own mix of them.
    dense_width = whole.ffn_hidden_size
    moe_width = dense_width
    if whole.moe is not None:
        moe_width = max(
            1, round(whole.shared_params_per_moe_layer / (whole.mlp_matrices * whole.hidden_size))
        )
    dense_blocks_saved = saved_per_token(model.model_copy(update={"ffn_hidden_size": dense_width}))
    moe_blocks_saved = dense_blocks_saved
    if moe_width != dense_width:
        moe_blocks_saved = saved_per_token(model.model_copy(update={"ffn_hidden_size": moe_width}))
    per_layer = np.zeros(len(p))  # what every block saves beside those (below)
    recompute_peak = np.zeros(len(p))
    modules = workload.recompute_modules
    if set(modules) != {"core_attn"}:  # Megatron-Core's fine-grained selective recompute (megatron plans)
        g = moe.saved_gemm_input_bytes(p, d)
        fine = te & (p.recompute == 1)
        args = (whole, modules, p.tp, p.sequence_parallel, d, g)
        dense_delta = checkpointing.megatron_modules_bytes_per_token_per_layer(
            *args, dense_width, "mlp" in modules
        )
        moe_delta = checkpointing.megatron_modules_bytes_per_token_per_layer(
            *args, moe_width, bool({"shared_experts", "moe"} & set(modules))
        )
        dense_blocks_saved = (dense_blocks_saved[0] + np.where(fine, dense_delta, 0.0), dense_blocks_saved[1])
        moe_blocks_saved = (moe_blocks_saved[0] + np.where(fine, moe_delta, 0.0), moe_blocks_saved[1])
    # Ulysses' extra saved tensors belong to the attention sub-block: selective and full recompute do
    # not keep them; full recompute re-creates them with the block in backward.
    ulysses = context.ulysses_saved_bytes_per_token_per_layer(model, p.tp, p.cp, p.engine, d)
    per_layer = per_layer + np.where(p.recompute == 0, ulysses, 0.0)
    recompute_peak = recompute_peak + tokens * np.where(p.recompute == 2, ulysses, 0.0)
    in_flight = mem.micro_batches_in_flight(p.pp, p.grad_accum, p.virtual_stages)
    boundary = np.where(p.pp > 1, 2.0 * tokens * model.hidden_size * d, 0.0)  # a stage's send and receive
    vocab_split = mem.vocab_parallel(p.engine)
    fused_loss = workload.fused_cross_entropy
    sp = p.sequence_parallel
    logits_per_token = mem.logits_bytes_per_token(model, d, s, p.tp, sp, vocab_split, fused_loss)
    pb, _, _ = mem.state_bytes_per_param(p.precision, p.zero_stage)
    first_psi, last_psi = moe.stage_params_per_gpu(whole, p, vocab_split)  # each stage's own MLPs
    first_moe, last_moe, _ = moe.moe_blocks_per_stage(whole, p.pp, p.virtual_stages)
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
        params, grads, optimizer, cpu = model_states(model, p, psi, workload.grad_reduce_in_fp32)
        logits = np.where(is_last, tokens * logits_per_token, 0.0)
        transient = tokens * mem.logits_transient_bytes_per_token(model, d, p.tp, vocab_split, fused_loss)
        transient = transient + mem.fused_loss_buffer_bytes(model, d, fused_loss)
        transient = np.where(is_last, transient, 0.0)
        # One send/receive pair per micro-batch the stage holds in flight; where the engine frees each
        # sent output (EngineRules.pipeline_output_deallocation) the received input is the tensor the first
        # block saves anyway, and only the pair in transit is extra.
        in_transit = np.where(p.engine_column("pipeline_output_deallocation"), 1.0, micro_batches)
        pipe_buffers = boundary * in_transit
        buffers = buckets * pb * mem.zero_buffer_elements(model, p.zero_stage, psi) + pipe_buffers + transient
        buffers = buffers + context.buffer_bytes(model, tokens, p.tp, p.cp, p.engine, d)
        matmul = (model.attention_params_per_layer + model.mlp_params_per_layer) / p.tp * layers
        matmul = matmul / np.where(p.zero_stage == 3, hz.shard_ranks(p), 1)
        # The routed experts' GEMMs run in FP8 too (moe.py), so their weights get FP8 copies as well: of
        # the rank's experts, or its shard of them where ZeRO-3 / FSDP gathers them.
        expert_matmul = moe.expert_params_per_gpu(whole, moe_blocks, p)
        expert_matmul = expert_matmul / np.where(p.zero_stage == 3, moe.expert_data_parallel(p), 1)
        buffers = buffers + fp8.extra_memory_bytes(matmul + expert_matmul, layers, p.precision)
        # ZeRO-1/2 with optimizer offload stages each gradient through a device buffer the size of the
        # largest parameter, the embedding (stage_1_and_2.py `temp_grad_buffer_for_gpu_offload`).
        offload_staging = p.offload_optimizer & (p.zero_stage >= 1) & (p.zero_stage <= 2)
        buffers = buffers + np.where(offload_staging, pb * model.vocab_size * model.hidden_size, 0.0)
        state_bytes = mem.plan_state_bytes(p, workload.grad_reduce_in_fp32)
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
        dense_blocks = layers - moe_blocks
        saved = dense_blocks * dense_blocks_saved[0] + moe_blocks * moe_blocks_saved[0]
        # the largest block the stage recomputes, of the kinds it holds
        block_peak = np.maximum(
            np.where(dense_blocks > 0, dense_blocks_saved[1], 0.0),
            np.where(moe_blocks > 0, moe_blocks_saved[1], 0.0),
        )
        # A fully recomputed block is rebuilt in backward only after the loss has freed its tensors, so
        # the peak holds one of the two, not both (measured on the proxy, tests/train).
        peak = np.maximum(tokens * block_peak + recompute_peak + x.recompute_peak - logits, 0.0)
        activations = tokens * (saved + per_layer * layers) * micro_batches + x.saved + peak
        activations = activation_scale * activations
        experts = x.params + x.grads + x.optimizer
        stages.append(StageMemoryTerms(params, grads, optimizer, activations, logits, buffers, cpu, experts))
    return stages[0], stages[1]
