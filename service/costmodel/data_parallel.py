"""Data-parallel time: ZeRO / FSDP collectives after overlap, host offload's exposed time (offload.py)
and the GPU optimizer step (the terms of one optimizer step that scale with the model state, not with
the tokens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from service.costmodel import buckets as buckets_mod
from service.costmodel import comm, compute
from service.costmodel import hierarchical_zero as hz
from service.costmodel import memory as mem
from service.costmodel import offload as offload_mod
from service.costmodel.types import Num, on_distinct_ints
from service.spec.hardware import ClusterSpec, GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable, engine_table
from service.spec.zero import ZeroKnobs


def module_elements_per_block(model: ModelSpec) -> list[int]:
    """Elements of each weight matrix of a block, in the order forward runs them (the modules ZeRO-3
    gathers one by one): Llama style q, k, v, o, gate, up, down; GPT style fused QKV, attention output,
    MLP in, MLP out."""
    h, f = model.hidden_size, model.ffn_hidden_size
    if model.mla is not None or model.weight_matrices_per_block == 7:
        return [p.elements for p in model.attention_projections] + [h * f, h * f, f * h]
    return [h * (model.q_width + model.kv_width), model.attention_out_width * h, h * f, f * h]


def held_back_gather_fraction(model: ModelSpec, tp: Num, max_live_elements: int) -> np.ndarray:
    """Share of ZeRO-3's gathered bytes that DeepSpeed cannot prefetch: it prefetches the next module
    only while the parameters it holds gathered stay under `stage3_max_live_parameters`
    (partitioned_param_coordinator.py, 0.19: max_params_to_prefetch = min(max live − available,
    prefetch bucket); v0.3.16 stage3.py: prefetch only `if total_available_parameter_numel <
    max_available_parameters_in_numel`). A module of at least that many elements holds back the gather
    of the module after it, which then waits whole: in forward the next module, in backward the one
    before (the mean of the two passes, which gather the same bytes). It takes matrices of ≥ 1e9
    elements (the default): a 530B GPT's QKV and MLP, not a 70B Llama's."""
    return _per_tp(lambda t: _held_back(model, t, max_live_elements), tp)


def _per_tp(fn: Callable[[np.ndarray], np.ndarray], tp: Num) -> np.ndarray:
    """`fn(tp)`, a per-module matrix reduced to one number per plan, computed once per distinct TP size
    (a plan table holds a handful of TP sizes among millions of plans)."""
    return np.asarray(on_distinct_ints(fn, np.atleast_1d(np.asarray(tp))), dtype=float)


def _held_back(model: ModelSpec, tp: np.ndarray, max_live_elements: int) -> np.ndarray:
    sizes = np.array(module_elements_per_block(model), dtype=float)
    tp = np.atleast_1d(np.asarray(tp, dtype=float))
    local = sizes[None, :] / tp[:, None]
    # np.roll wraps: the first module's predecessor is the block before's last, and so on.
    forward = np.roll(local, 1, axis=1) >= max_live_elements
    backward = np.roll(local, -1, axis=1) >= max_live_elements
    held = (local * forward).sum(axis=1) + (local * backward).sum(axis=1)
    return np.asarray(held / (2 * local.sum(axis=1)), dtype=float)


def regathered_fraction(model: ModelSpec, tp: Num, max_reuse_elements: int) -> np.ndarray:
    """Share of a block's weights that DeepSpeed's ZeRO-3 gathers a third time when the block is fully
    recomputed. Backward re-runs the block's forward (gathering every module again) and then runs the
    modules' backward in reverse. After a module's recomputed forward DeepSpeed keeps its parameters
    only if their next use, that module's backward, comes before the modules in between hold
    `stage3_max_reuse_distance` elements (partitioned_param_coordinator.py, 0.19 `__params_to_release`:
    it scans the trace from the next module and stops at the limit; v0.3.16 `_keep_for_later`, the same
    test). Between module j's recomputed forward and its backward lie the modules after it, twice
    (forward and backward): kept when 2·Σ(later modules) < the limit, gathered again otherwise. In a
    175B or 530B GPT block all but the MLP-out are gathered again (two thirds of the weights); in a
    Llama-2-70B block the attention projections (18 %); in a 13B block none."""

    def fraction(t: np.ndarray) -> np.ndarray:
        local, again = _regathered(model, t, max_reuse_elements)
        return np.asarray((local * again).sum(axis=1) / local.sum(axis=1), dtype=float)

    return _per_tp(fraction, tp)


def regathered_modules(model: ModelSpec, tp: Num, max_reuse_elements: int) -> np.ndarray:
    """How many of a block's modules `regathered_fraction` gathers a third time (one call each)."""
    return _per_tp(
        lambda t: np.asarray(_regathered(model, t, max_reuse_elements)[1].sum(axis=1), dtype=float), tp
    )


def _regathered(model: ModelSpec, tp: Num, max_reuse_elements: int) -> tuple[np.ndarray, np.ndarray]:
    """Per plan (rows) and module (columns): its elements on one TP rank, and whether it is regathered."""
    sizes = np.array(module_elements_per_block(model), dtype=float)
    tp = np.atleast_1d(np.asarray(tp, dtype=float))
    local = sizes[None, :] / tp[:, None]
    later = np.cumsum(local[:, ::-1], axis=1)[:, ::-1] - local  # Σ of the modules after each one
    return local, 2 * later >= max_reuse_elements


def block_sharded(p: PlanTable) -> np.ndarray:
    """Per plan, whether its engine gathers and reduces one transformer block at a time at its ZeRO stage
    (FSDP, Megatron-FSDP: the engine's `block_sharding_from_stage`), not in buckets or per module."""
    from_stage = np.array([4 if s is None else s for s in engine_table("block_sharding_from_stage")])
    return np.asarray(p.zero_stage >= from_stage[p.engine])


@dataclass(frozen=True)
class ZeroTraffic:
    """One optimizer step's data-parallel collectives, per plan (seconds unless named otherwise)."""

    psi: np.ndarray  # parameters per GPU of the busiest pipeline stage
    fsdp: np.ndarray  # per-block gathers and reduces (FSDP, Megatron-FSDP)
    all_reduce: Num  # the gradients' all-reduce (stage 0)
    reduce: np.ndarray  # the gradients' reduction in stages 1-2: all-reduce or reduce-scatter (engine rule)
    gather: Num  # the updated parameters' all-gather
    per_micro_batch: np.ndarray  # ZeRO-3's gathers and reduces of one micro-batch, third gathers included
    unhidden: np.ndarray  # the part of those that hides behind no compute
    list_copies: np.ndarray  # the legacy per-rank list copies' launches, per micro-batch
    per_step: np.ndarray  # ZeRO-3's once-per-step collectives
    regather: np.ndarray  # share of the weights gathered a third time (full recompute)


def zero_traffic(
    model: ModelSpec,
    cluster: ClusterSpec,
    p: PlanTable,
    gpu: GPUSpec,
    net: comm.Links,
    per_tensor_lists: bool = False,
    whole: ModelSpec | None = None,
    fp32_grads: bool = False,
) -> ZeroTraffic:
    """What one optimizer step of the plan's data-parallel sharding moves and how (`ZeroTraffic`), which
    `exposed_comm_s`, `exposed_offload_s` and `optimizer_step_s` price.

    ZeRO communication (Rajbhandari et al. 2020, §7): stage 0 all-reduces gradients once per step after
    backward (DeepSpeed's engine, not overlapped); stages 1-2 reduce-scatter gradients overlapped with
    backward (stage 1 once per step, stage 2 every micro-batch) and all-gather the updated parameters
    after the step; stage 3 all-gathers parameters in forward and backward and reduce-scatters gradients
    every micro-batch, prefetched behind compute. A collective hidden behind compute still slows it by
    `contention` × its time (NCCL's kernels hold SMs: comm.overlapped_exposed_s).

    FSDP (Zhao et al. 2023, "PyTorch FSDP", §3-4) gathers and reduces one flat parameter per wrapped
    unit, a transformer block, so it issues one collective per block instead of per bucket or module;
    SHARD_GRAD_OP (stage 2) re-gathers the parameters in the next forward, prefetched behind it.

    `per_tensor_lists` (Workload.zero3_collectives): DeepSpeed's ZeRO-3 before 0.6, as the 2021 papers
    ran it (deepspeed/runtime/zero/partition_parameters.py at v0.3.16-v0.5.10: `_allgather_param`,
    `_reduce_scatter_gradient`). It gathers each weight matrix on its own (tensors under
    `stage3_param_persistence_threshold`, 1e5 elements, biases and norms, stay whole) but reduce-scatters
    every parameter tensor's gradient on its own, and hands torch.distributed lists of per-rank slices;
    PyTorch's NCCL process group then copies each of the n slices with its own kernel
    (ProcessGroupNCCL::allgather copies the flat output into every list entry; reduce_scatter's
    flatten_for_scatter_gather copies every input in). Those n launches per call cost the host n kernel
    launches; DeepSpeed synchronises the device before each gather (`torch.cuda.synchronize()` in
    `_allgather_param`), so nothing queued hides them. DeepSpeed 0.6 moved to one flat
    `_all_gather_base` per module and `reduce_scatter_coalesced` per bucket. The same versions
    synchronise the device before every module's backward, so their gradient reduce-scatters are not
    overlapped (see `unhidden` below).
    """
    gpn = cluster.gpus_per_node
    pb, gb, _ = mem.plan_state_bytes(p, fp32_grads)
    # `model` is a MoE model's dense view (of `whole`): each stage moves its own dense blocks and shared
    # experts, not the view's mean MLP (costmodel/moe.py `stage_params_per_gpu`).
    if whole is not None and whole.moe is not None:
        from service.costmodel import moe

        first, last = moe.stage_params_per_gpu(whole, p, mem.vocab_parallel(p.engine))
    else:
        first, last = mem.stage_params_per_gpu(
            model, p.tp, p.pp, p.virtual_stages, mem.vocab_parallel(p.engine)
        )
    psi = np.maximum(first, last)
    grads_b, params_b = psi * gb, psi * pb
    # Stages 0-2 reduce gradients in buckets (costmodel/buckets.py: a greedy packing of the tensors) and
    # gather the updated parameters in one call; stage 3 gathers each block's weight matrices module by
    # module (DeepSpeed's per-submodule fetch); FSDP one flat parameter per block, and so does
    # Megatron-FSDP (megatron at zero_stage 2-3), whose buckets follow the transformer layers.
    knobs = ZeroKnobs.for_model(model)
    buckets = buckets_mod.gradient_reduce_calls(model, p.tp, p.pp, knobs.reduce_bucket_elements)
    blocks = mem.stage_layers(model.num_layers, p.pp, p.virtual_stages)[0]  # the busiest stage's
    modules = blocks * model.weight_matrices_per_block
    fsdp = block_sharded(p)
    collectives = np.where(fsdp, blocks, np.where(p.zero_stage == 3, modules, buckets))
    gathers = np.where(fsdp | (p.zero_stage == 3), collectives, buckets_mod.PARAM_GATHER_CALLS)
    shards = p.dp * p.cp  # gradients are reduced over the context-parallel ranks too (context.py)
    ar = comm.all_reduce_time_s(grads_b, shards, p.tp, gpn, gpu, buckets, net)
    rs = comm.reduce_scatter_time_s(grads_b, shards, p.tp, gpn, gpu, collectives, net)
    ag = comm.all_gather_time_s(params_b, shards, p.tp, gpn, gpu, gathers, net)
    legacy = per_tensor_lists & (p.zero_stage == 3) & ~fsdp
    tensors = blocks * model.parameter_tensors_per_block
    reduces = np.where(legacy, tensors, collectives)
    z3 = hz.zero3_collectives_s(p, params_b, grads_b, gpn, gpu, collectives, net, reduces)
    # A fully recomputed block gathers its weights in forward and in the recomputed forward; DeepSpeed
    # gathers a share of them once more for backward (regathered_fraction). FSDP's recompute runs inside
    # the unit whose backward gather it uses.
    third = ~fsdp & (p.recompute == 2)
    reuse = knobs.stage3_max_reuse_distance
    regather = np.where(third, regathered_fraction(model, p.tp, reuse), 0.0)
    per_micro_batch = z3.per_micro_batch + regather * z3.backward_gather
    # One more gather call per regathered module and block (the legacy list copies count calls).
    regather_calls = np.where(third, regathered_modules(model, p.tp, reuse) * blocks, 0.0)
    # DeepSpeed's prefetch stops at stage3_max_live_parameters (held_back_gather_fraction); FSDP
    # prefetches the next block whatever its size.
    held = np.where(fsdp, 0.0, held_back_gather_fraction(model, p.tp, knobs.stage3_max_live_parameters))
    # DeepSpeed before 0.6 also synchronises the whole device whenever a module's parameters are in
    # flight or need gathering (stage3.py v0.3.16-v0.5.10 `fetch_sub_module` → `_synchronize_communication`:
    # `torch.cuda.synchronize()`; 0.6 waits on per-gather events instead). The reduce-scatter that a
    # module's gradients start once its backward is done must therefore finish before the host launches
    # anything of the module before it: it hides behind no compute.
    unhidden = held * z3.gathers + np.where(legacy, z3.reduces, 0.0)
    # The list copies: one kernel per rank of the sharding group for each gather (forward, backward) and
    # each gradient reduce-scatter of a micro-batch, launched by the host (see the docstring).
    launches = np.where(legacy, (2 * gathers + regather_calls + reduces) * hz.shard_ranks(p), 0.0)
    list_copies = launches * gpu.kernel_overhead_us * 1e-6
    # DeepSpeed's ZeRO 1-2 reduce each gradient bucket with an all-reduce and keep their partition of it
    # (stage_1_and_2.py `average_tensor`: `use_multi_rank_bucket_allreduce`, on by default); FSDP and
    # Megatron's distributed optimizer reduce-scatter.
    reduce = np.where(p.engine_is("gradient_reduce", "all_reduce"), ar, rs)
    return ZeroTraffic(
        psi, fsdp, ar, reduce, ag, per_micro_batch, unhidden, list_copies, z3.per_step, regather
    )


def exposed_comm_s(
    t: ZeroTraffic, p: PlanTable, fwd: np.ndarray, bwd: np.ndarray, contention: float = 0.0
) -> np.ndarray:
    """Data-parallel communication the step waits for, after overlap with the forward (`fwd`) and
    backward (`bwd`) of one micro-batch (see `zero_traffic` for what each stage moves)."""
    ar, reduce, ag, fsdp = t.all_reduce, t.reduce, t.gather, t.fsdp
    ga = p.grad_accum

    def behind(collective: Num, compute_s: Num) -> np.ndarray:
        return np.asarray(comm.overlapped_exposed_s(collective, compute_s, contention), dtype=float)

    # Megatron-Core's --overlap-grad-reduce starts each gradient bucket's reduction as backward finishes
    # it (DDP's all-reduce, or the distributed optimizer's reduce-scatter), and --overlap-param-gather
    # gathers the updated parameters bucket by bucket ahead of the next step's forward
    # (megatron/core/distributed/distributed_data_parallel.py, param_and_grad_buffer.py).
    # Megatron-Core keeps one grad and param buffer per model chunk (param_and_grad_buffer.py, one per
    # `model` chunk in distributed_data_parallel.py). With v interleaved chunks, a chunk's reduce starts
    # once its last backward is done, while the other chunks' cooldown backward still runs, and a chunk's
    # gather runs while the earlier chunks' warmup forwards do (Narayanan et al. 2021 §2.2.2: each chunk
    # passes pp micro-batches in turn). Only the last chunk's reduce and the first chunk's gather wait on
    # their own micro-batch; the other (v − 1)/v hide behind (v − 1)/v of pp micro-batches' compute.
    overlap = p.comm_overlap
    v = p.virtual_stages
    turn = np.minimum(p.pp, ga) * (v - 1) / v  # micro-batch slots of the other chunks per chunk turn

    def behind_chunks(collective: Num, compute_s: Num) -> np.ndarray:
        own = behind(collective / v, compute_s / v)
        return own + behind(collective * (v - 1) / v, turn * compute_s)

    dp_comm = np.select(
        [p.zero_stage == 0, p.zero_stage == 1, p.zero_stage == 2],
        [
            np.where(overlap, behind_chunks(ar, bwd), ar),
            np.where(overlap, behind_chunks(reduce, bwd) + behind_chunks(ag, fwd), behind(reduce, bwd) + ag),
            ga * behind(reduce, bwd) + np.where(fsdp, behind(ag, fwd), ag),
        ],
        ga * (behind(t.per_micro_batch - t.unhidden, fwd + bwd) + t.unhidden + t.list_copies) + t.per_step,
    )
    return np.asarray(dp_comm, dtype=float)


def in_series(first: ZeroTraffic, second: ZeroTraffic) -> ZeroTraffic:
    """Two slices' collectives issued one after the other in the same windows (a MoE model's dense and
    expert gradients: Megatron-Core reduces its expert buffers on the same stream after the dense ones,
    DeepSpeed's ZeRO 1-2 reduce the expert parameter groups in the same bucket flow), so they hide
    behind one window's compute together, not each behind all of it. `psi` and `regather` stay the
    first slice's (what `optimizer_step_s` and the offload fetches read)."""
    return ZeroTraffic(
        psi=first.psi,
        fsdp=first.fsdp,
        all_reduce=first.all_reduce + second.all_reduce,
        reduce=first.reduce + second.reduce,
        gather=first.gather + second.gather,
        per_micro_batch=first.per_micro_batch + second.per_micro_batch,
        unhidden=first.unhidden + second.unhidden,
        list_copies=first.list_copies + second.list_copies,
        per_step=first.per_step + second.per_step,
        regather=first.regather,
    )


def exposed_offload_s(
    t: ZeroTraffic,
    slices: list[offload_mod.OffloadSlice],
    p: PlanTable,
    fwd: np.ndarray,
    bwd: np.ndarray,
    gpu: GPUSpec,
    contention: float = 0.0,
) -> np.ndarray:
    """Host offload's exposed time for `slices` (offload.py): their copies hide in series with the
    collectives `t` of their window, a micro-batch (stages 2-3) or the reducing backward (stage 1); no
    window without overlap (contention 1)."""
    hideable = np.where(p.zero_stage == 3, t.per_micro_batch - t.unhidden, t.reduce)
    window = np.where(contention < 1.0, np.where(p.zero_stage == 3, fwd + bwd, bwd), 0.0)
    return np.asarray(offload_mod.offload_time_s(p, slices, 2.0 + t.regather, hideable, window, gpu))


def optimizer_step_s(t: ZeroTraffic, p: PlanTable, gpu: GPUSpec) -> np.ndarray:
    """The GPU optimizer step over this rank's shard of the stage's parameters (none when offloaded)."""
    shard = t.psi / np.where(p.zero_stage >= 1, hz.shard_ranks(p), 1)
    return np.asarray(np.where(p.offload_optimizer, 0.0, compute.optimizer_step_time_s(shard, gpu)))
