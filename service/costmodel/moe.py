"""Mixture-of-experts terms, one function per term: the routed experts' model states, activations and
buffers, their grouped GEMMs, the router and token permutation (the dispatch and combine of every MoE
block: costmodel/expert_exchange.py). Everything else of a MoE model (attention, the dense blocks'
MLPs, the shared experts, the router's weights) is priced by the dense terms on
`ModelSpec.dense_view()`.

Layout (`Plan.ep`, `Plan.expert_tp`, the engine's `expert_parallel` rule): one MoE block's experts are
split over ep ranks and, inside each expert, over expert_tp ranks; the ranks of a pipeline stage that
hold the same expert slice form the expert-data-parallel group, over which the experts' gradients are
reduced and ZeRO shards their states. Tokens: each rank dispatches its own share of a micro-batch,
t = micro_batch·s / (cp·tp) (Megatron-Core requires sequence parallelism with MoE and TP, torchtitan
splits the tokens over the TP ranks, DeepSpeed drops the tokens its TP ranks duplicate: sharded_moe.py
`drop_tokens`), k copies of each after routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel import compute, fp8
from service.costmodel import memory as mem
from service.costmodel.types import Num, on_distinct
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable

# Router logits and the top-k probabilities are kept in fp32 (Megatron-Core router.py casts the logits
# with --moe-router-dtype fp32 in NVIDIA's recipes; DeepSpeed's top-k gating runs softmax in fp32).
ROUTER_BYTES = 4.0
# HBM passes over the routed tokens outside the expert GEMMs, forward: permute (read, write) and
# unpermute with the combine weights (read, write) (Megatron-Core moe_utils.py permute / unpermute;
# torchtitan's generate_permute_indices + index copies; DeepSpeed's `_sparse_encode` / `_sparse_decode`
# gathers into and out of its experts × capacity buffer).
PERMUTE_PASSES = 4.0


def expert_data_parallel(p: PlanTable) -> np.ndarray:
    """Ranks of a pipeline stage holding the same expert slice, over which expert gradients are reduced
    and ZeRO shards expert states: dp·cp·tp / (ep·expert_tp) (the expert layout folded over the stage's
    ranks: Megatron-Core parallel_state.py; DeepSpeed utils/groups.py; torchtitan's efsdp)."""
    return p.dp * p.cp * p.tp // (p.ep * p.expert_tp)


def ep_stride(p: PlanTable) -> np.ndarray:
    """Rank distance between the members of an EP group: the expert layout runs expert_tp fastest,
    then ep (Megatron-Core's order tp-ep-dp; DeepSpeed's consecutive expert groups, strided by tp when
    its experts are split over the TP ranks; torchtitan's innermost ep ranks)."""
    return p.expert_tp


def gather_group(p: PlanTable) -> np.ndarray:
    """Ranks that exchange the received tokens around the expert GEMMs: the expert-TP group, or
    DeepSpeed's TP ranks (`regathers_over_tp`)."""
    return np.where(p.expert_rule_column("regathers_over_tp"), p.tp, p.expert_tp)


def load_factor(model: ModelSpec, p: PlanTable, imbalance: float) -> np.ndarray:
    """Tokens the busiest expert rank processes over the balanced share, per plan.

    A capacity router pads every expert to capacity_factor × the balanced share (GShard, Lepikhin et al.
    2020, §2.2: the dispatch tensor is experts × capacity; DeepSpeed sends all of its buffer) and drops
    the rest. Dropless routing (MegaBlocks, Gale et al. 2022) runs the load as it comes (DeepSpeed pads
    every expert to the busiest one's tokens, `topkgating` with drop_tokens=False), so the
    busiest rank holds `imbalance` × its share (Workload.moe_load_imbalance; the default is Wang et al.
    2024, arXiv 2408.15664, Table 2: max/mean expert load 1.52 for the 3B model trained with an
    auxiliary balancing loss). It is applied to the rank as a whole: the published dropless and
    force-balanced pairs (benchmarks/moe_accuracy.py) do not show a rank's several experts averaging
    their skew out (Qwen3-235B with 16 experts per rank loses more to imbalance than Mixtral with one).
    Without expert parallelism (ep 1) a rank holds every expert and routes each of its tokens' k copies
    to itself, so a grouped-GEMM layer (Megatron-Core, torchtitan), which runs the tokens as they come,
    has no busiest rank to wait for: its load is 1. DeepSpeed's dropless layer still pads every local
    expert to the busiest one's count.
    """
    moe = model.moe
    if moe is None:
        return np.ones(len(p))
    capacity = moe.capacity_factor if moe.router == "capacity" else None  # validated: set with capacity
    if capacity is not None:
        return np.full(len(p), float(capacity))
    pads = p.expert_rule_column("layer") == "deepspeed_moe"
    return np.where((p.ep == 1) & ~pads, 1.0, float(imbalance))


def tokens_dispatched(p: PlanTable, seq_len: int) -> np.ndarray:
    """Tokens of one micro-batch one rank routes (see the module docstring)."""
    return p.micro_batch * seq_len / (p.cp * p.tp)


def moe_blocks_per_stage(
    model: ModelSpec, pp: Num, virtual_stages: Num = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MoE blocks on the first, on the last and on the busiest pipeline stage, per plan.

    The blocks split into pp·v chunks as `memory.stage_layers` lays them out (the first L mod pp·v
    chunks one block longer) and stage r holds chunks r, r + pp, ... (Narayanan et al. 2021 §2.2.2);
    the model's dense blocks (`MoESpec.first_dense_layers`, `layer_frequency`) fall where their index
    puts them, so the first stage of DeepSeek-V3 holds its three dense blocks."""
    pp_a, v_a = np.broadcast_arrays(
        np.asarray(pp, dtype=np.int64), np.asarray(virtual_stages, dtype=np.int64)
    )
    if model.moe is None:
        return np.zeros(pp_a.shape), np.zeros(pp_a.shape), np.zeros(pp_a.shape)
    moe = model.moe
    is_moe = np.array([moe.is_moe_layer(i) for i in range(model.num_layers)], dtype=float)

    def per_pair(pps: np.ndarray, vs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = np.zeros((3, len(pps)))
        for i, (pp_i, v_i) in enumerate(zip(pps.tolist(), vs.tolist(), strict=True)):
            chunks = pp_i * v_i
            base, extra = divmod(model.num_layers, chunks)
            sizes = np.full(chunks, base) + (np.arange(chunks) < extra)
            bounds = np.concatenate([[0], np.cumsum(sizes)])
            per_chunk = np.array([is_moe[bounds[c] : bounds[c + 1]].sum() for c in range(chunks)])
            per_stage = per_chunk.reshape(v_i, pp_i).sum(axis=0)
            out[:, i] = per_stage[0], per_stage[-1], per_stage.max()
        return out[0], out[1], out[2]

    first, last, most = on_distinct(per_pair, pp_a.ravel(), v_a.ravel())
    return first.reshape(pp_a.shape), last.reshape(pp_a.shape), most.reshape(pp_a.shape)


def expert_params_per_gpu(model: ModelSpec, moe_blocks: Num, p: PlanTable) -> np.ndarray:
    """Routed-expert parameters one GPU holds for `moe_blocks` MoE blocks of its stage: each block's
    experts split by ep and, inside each, by expert_tp."""
    return np.asarray(model.expert_params_per_moe_layer * moe_blocks / (p.ep * p.expert_tp), dtype=float)


def stage_params_per_gpu(model: ModelSpec, p: PlanTable, vocab_split: Num) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) pipeline stage's parameters per GPU outside the routed experts (what step_memory
    stores and data_parallel moves): the dense view's (memory.stage_params_per_gpu), a MoE model's
    corrected by what each stage's dense blocks' MLPs and MoE blocks' shared experts and routers hold
    beyond the view's mean MLP, per TP rank (negative on a stage of MoE blocks only)."""
    view = model.dense_view()
    first, last = mem.stage_params_per_gpu(view, p.tp, p.pp, p.virtual_stages, vocab_split)
    if model.moe is None:
        return first, last

    def excess(layers: Num, moe_blocks: Num) -> np.ndarray:
        dense_blocks = np.asarray(layers, dtype=float) - moe_blocks
        held = dense_blocks * model.mlp_params_per_layer + moe_blocks * model.shared_params_per_moe_layer
        return np.asarray((held - layers * view.mlp_params_per_layer) / p.tp, dtype=float)

    first_moe, last_moe, _ = moe_blocks_per_stage(model, p.pp, p.virtual_stages)
    first_layers, last_layers = mem.stage_layers(view.num_layers, p.pp, p.virtual_stages)
    return first + excess(first_layers, first_moe), last + excess(last_layers, last_moe)


def expert_state_bytes(
    psi_expert: Num, p: PlanTable, param_bytes: Num, grad_bytes: Num, optimizer_bytes: Num
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(params, grads, optimizer, host) bytes of the expert slice after ZeRO over the expert-data-parallel
    group (ZeRO, Rajbhandari et al. 2020 §5, applied to the experts' own group: DeepSpeed's stage_1_and_2.py
    partitions each MoE parameter group over `expert_data_parallel_group`; Megatron's distributed
    optimizer shards expert states over the expert-data-parallel group). Offload moves them as the dense
    states move (step_memory.model_states; the flags are the plan's): the optimizer states to the host
    and, from stage 2, the fp32 gradient partition there too, stage 2 accumulating its gradients straight
    into that host buffer; parameter offload (stage 3) moves the parameter partitions."""
    edp = expert_data_parallel(p)
    z = p.zero_stage
    params = param_bytes * psi_expert / np.where(z >= 3, edp, 1)
    grads = grad_bytes * psi_expert / np.where(z >= 2, edp, 1)
    optimizer = optimizer_bytes * psi_expert / np.where(z >= 1, edp, 1)
    host = np.where(p.offload_optimizer, optimizer, 0.0) + np.where(p.offload_params, params, 0.0)
    host = host + np.where(p.offload_optimizer & (z >= 2), 4.0 * psi_expert / edp, 0.0)
    optimizer = np.where(p.offload_optimizer, 0.0, optimizer)
    grads = np.where(p.offload_optimizer & (z == 2), 0.0, grads)
    params = np.where(p.offload_params, 0.0, params)
    return params, grads, optimizer, host


def activation_bytes_per_token_per_moe_layer(model: ModelSpec, p: PlanTable, d: Num, load: Num) -> np.ndarray:
    """Bytes a MoE block saves for backward per dispatched token, beyond the dense view's share.

    Per routed slot (k per token × the load factor on the busiest rank × expert_tp, whose group's tokens
    each rank computes; a capacity router's padded slots): the permuted input and the expert MLP's own
    tensors, split by expert_tp: a SwiGLU MLP of eager modules keeps gate, act(gate), up and their product
    (4f, as `memory.py` counts Hugging Face's Llama MLP), Transformer Engine's fused SwiGLU the fc1 output
    and fc2's input (3f); a GeLU MLP 2f. DeepSpeed's experts each slice the all-to-all output for their gate
    and up projections, which save a copy each when ep > 1 (a second h per slot). Per token: the k expert
    outputs the combine weighs (unpadded: the combine gathers each token's routes back first) and the
    router's tensors: DeepSpeed's top-k gating keeps fp32 probabilities and one fp32 one-hot mask per chosen
    expert, E·4·(1 + k), a boolean mask and the gate values and indices (12k + 16); a grouped layer the fp32
    logits and probabilities and a boolean routing map, 9E (Megatron-Core router.py, moe_utils.py). Measured
    on the DeepSpeed proxy within 0.1 % (tests/train/test_moe_proxy.py). In FP8, Transformer Engine's
    grouped GEMMs keep their inputs (the permuted token, fc2's input) in 1 byte. Without recompute; full
    recompute keeps none of them between forward and backward (`stage_memory`)."""
    moe = model.moe
    assert moe is not None
    h, f, k, e = model.hidden_size, moe.expert_ffn_hidden_size, moe.experts_per_token, moe.num_experts
    deepspeed = p.expert_rule_column("layer") == "deepspeed_moe"
    fused = p.engine_column("transformer_engine")
    swiglu = np.where(fused, 3.0, 4.0) if model.mlp == "swiglu" else 2.0
    inputs = np.where(deepspeed & (p.ep > 1), 2.0, 1.0)
    # TE's grouped GEMMs in FP8 save their inputs cast (1 byte): fc1's, the permuted token, and fc2's, f
    # of the fused SwiGLU's 3f (transformer_engine/pytorch/module/grouped_linear.py saves the quantized
    # `inputmats`), as `memory.te_layer_bytes_per_token` counts the dense GEMMs' inputs.
    g = saved_gemm_input_bytes(p, d)
    mlp = (d * (swiglu - 1) + g) * f / p.expert_tp
    per_slot = mlp + g * inputs * h + np.where(deepspeed, 8.0, 0.0)
    router = np.where(deepspeed, ROUTER_BYTES * e * (1 + k) + e + 12 * k + 16, 9.0 * e)
    # An expert-TP group's ranks each compute every token routed to their experts' slices: a rank's
    # slots are its group's (expert_tp × its own), each f/expert_tp wide (`expert_gemm_time_forward_s`).
    return np.asarray(k * load * p.expert_tp * per_slot + d * k * h + router, dtype=float)


def saved_gemm_input_bytes(p: PlanTable, d: Num) -> np.ndarray:
    """Bytes per element of a GEMM input an expert MLP saves: 1 for Transformer Engine's grouped GEMMs in
    FP8 (they save the quantized input), d otherwise."""
    fused = p.engine_column("transformer_engine")
    return np.where(fused & (np.asarray(p.precision) == mem.PRECISION_FP8), 1.0, d)


def routed_slots(model: ModelSpec, p: PlanTable, seq_len: int, load: Num) -> np.ndarray:
    """Routed copies one rank's experts compute per micro-batch: its expert-TP group's tokens (each rank
    of the group computes its slice of the same experts for all of them), k copies each, × the load
    factor (the busiest rank; a capacity router's padding)."""
    moe = model.moe
    assert moe is not None
    return np.asarray(tokens_dispatched(p, seq_len) * p.expert_tp * moe.experts_per_token * load, dtype=float)


def activation_time_forward_s(
    model: ModelSpec, p: PlanTable, seq_len: int, gpu: GPUSpec, d: Num, load: Num
) -> np.ndarray:
    """One MoE block's expert activation function, in forward and again where Megatron-Core recomputes
    it ("moe_act"): per routed slot it reads fc1's output (2f for SwiGLU, f for GeLU) and writes fc2's
    input (f), in d, of the expert's f/expert_tp slice, at the HBM bandwidth (one fused pass: Megatron-
    Core's bias_swiglu_impl, torchtitan's compiled blocks). FP8's cast of fc2's input is
    `fp8_cast_time_forward_s`."""
    moe = model.moe
    assert moe is not None
    f = moe.expert_ffn_hidden_size / p.expert_tp
    gate = 2 if model.mlp == "swiglu" else 1
    moved = routed_slots(model, p, seq_len, load) * (gate + 1) * d * f
    return np.asarray(moved / (gpu.hbm_bandwidth_gb_per_s * 1e9), dtype=float)


def fp8_cast_time_forward_s(
    model: ModelSpec, p: PlanTable, seq_len: int, gpu: GPUSpec, load: Num, fc1: bool = True
) -> np.ndarray:
    """FP8 plans cast the inputs of the expert GEMMs before they run, per routed slot: fc1's (the
    permuted token, h; without `fc1`, fc2's alone) and fc2's (f/expert_tp), at
    `fp8.cast_bytes_per_element` (Transformer Engine's GroupedLinear quantizes each expert's slice of its
    input; torchao's scaled grouped GEMM its 2D input). A token is cast once per route, where a dense
    block casts its MLP input once: FP8 buys a MoE block less than a dense one of the same active width
    (torchao measured FP8 MoE training +10 % tokens/s at 2 experts per device, +1 % at 16, as the
    experts' GEMMs shrink and their per-group quantization weighs more: pytorch/ao pull request 2864)."""
    moe = model.moe
    assert moe is not None
    elements = (model.hidden_size if fc1 else 0) + moe.expert_ffn_hidden_size / p.expert_tp
    per_element = fp8.cast_bytes_per_element(p.precision, p.engine_is("fp8_scaling", "dynamic"))
    moved = routed_slots(model, p, seq_len, load) * elements * per_element
    return np.asarray(moved / (gpu.hbm_bandwidth_gb_per_s * 1e9), dtype=float)


def dispatch_buffer_bytes(model: ModelSpec, p: PlanTable, seq_len: int, d: Num, load: Num) -> np.ndarray:
    """One MoE block's all-to-all send and receive buffers of the routed copies, live while the block
    runs (Megatron-Core token_dispatcher.py: permuted tokens out, received tokens in; DeepSpeed: the
    experts × capacity dispatch tensor and its all-to-all output)."""
    moe = model.moe
    assert moe is not None
    copies = tokens_dispatched(p, seq_len) * moe.experts_per_token * load
    return 2.0 * copies * model.hidden_size * d * gather_group(p)


def expert_gemm_time_forward_s(
    model: ModelSpec, p: PlanTable, seq_len: int, gpu: GPUSpec, peak_flops: Num, d: Num, load: Num
) -> np.ndarray:
    """Forward GEMMs of one MoE block's local experts on the busiest rank: ep ranks exchange their
    tokens, so each holds num_experts/ep experts that receive, on average, t·k·expert_tp·ep/num_experts
    tokens each (× the load factor), at 1/expert_tp of the expert width. Each expert is a GEMM of its
    own (DeepSpeed's experts loop) or a slice of one grouped GEMM (Megatron-Core GroupedMLP, torchtitan
    torch._grouped_mm); either way a few hundred tokens per expert fill the tensor-core tiles less than a
    dense layer's thousands do (`compute.gemm_time_s`'s tile fill; MegaBlocks, Gale et al. 2022, §5)."""
    moe = model.moe
    assert moe is not None
    h, f = model.hidden_size, moe.expert_ffn_hidden_size
    local = moe.num_experts / p.ep
    m = tokens_dispatched(p, seq_len) * moe.experts_per_token * p.expert_tp * p.ep / moe.num_experts * load
    inner = f * (2 if model.mlp == "swiglu" else 1) / p.expert_tp
    up = compute.gemm_time_s(m, inner, h, gpu, peak_flops, d)
    down = compute.gemm_time_s(m, h, f / p.expert_tp, gpu, peak_flops, d)
    return np.asarray(local * (up + down), dtype=float)


def router_and_permute_time_forward_s(
    model: ModelSpec,
    p: PlanTable,
    seq_len: int,
    gpu: GPUSpec,
    peak_flops: Num,
    d: Num,
    load: Num,
    elementwise_scale: float = 1.0,
) -> np.ndarray:
    """The router's logits GEMM (t × num_experts × h), its softmax and top-k over fp32 logits (a read
    and a write each), and the permutation passes over the routed copies (PERMUTE_PASSES); the passes
    over HBM × `elementwise_scale` (ModelParams: the dense blocks' non-matmul traffic's fitted factor)."""
    moe = model.moe
    assert moe is not None
    t, h = tokens_dispatched(p, seq_len), model.hidden_size
    logits = compute.gemm_time_s(t, moe.num_experts, h, gpu, peak_flops, d)
    hbm = gpu.hbm_bandwidth_gb_per_s * 1e9
    softmax = t * moe.num_experts * ROUTER_BYTES * 4 / hbm
    permute = PERMUTE_PASSES * t * moe.experts_per_token * load * h * d / hbm
    return np.asarray(logits + elementwise_scale * (softmax + permute), dtype=float)


@dataclass(frozen=True)
class StageMemory:
    """A stage's MoE bytes per GPU, added to the dense view's terms (zeros for a dense model)."""

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    host: np.ndarray  # offloaded expert states
    saved: np.ndarray  # activations kept for backward, every micro-batch in flight
    recompute_peak: np.ndarray  # one fully recomputed block's MoE tensors, live in its backward
    buffers: np.ndarray  # one block's dispatch and combine buffers


def stage_memory(
    model: ModelSpec,
    p: PlanTable,
    seq_len: int,
    moe_blocks: Num,
    micro_batches: Num,
    d: Num,
    load: Num,
    state_bytes: tuple[np.ndarray, ...],
    recompute_modules: tuple[str, ...] = ("core_attn",),
) -> StageMemory:
    """The MoE terms of a stage holding `moe_blocks` MoE blocks and `micro_batches` in flight;
    `state_bytes` is (param, grad, optimizer) bytes per parameter (memory.state_bytes_per_param).
    A megatron plan's selective recompute (Workload.recompute_modules) drops the expert activation's
    output with "moe_act" (fc2's input, re-made in backward) and, with "moe", every MoE tensor but the
    block's input, as full recompute does."""
    if model.moe is None:
        zero = np.zeros(len(p))
        return StageMemory(zero, zero, zero, zero, zero, zero, zero)
    params, grads, optimizer, host = expert_state_bytes(
        expert_params_per_gpu(model, moe_blocks, p), p, *state_bytes
    )
    tokens = tokens_dispatched(p, seq_len)
    kept = tokens * activation_bytes_per_token_per_moe_layer(model, p, d, load)
    megatron_selective = p.engine_column("transformer_engine") & (p.recompute == 1)
    if "moe_act" in recompute_modules:
        # fc2's input: expert_tp × the rank's slots, each f/expert_tp wide (`routed_slots`).
        act = tokens * model.moe.experts_per_token * load * saved_gemm_input_bytes(p, d)
        kept = kept - np.where(megatron_selective, act * model.moe.expert_ffn_hidden_size, 0.0)
    full = (p.recompute == 2) | (megatron_selective & ("moe" in recompute_modules))
    return StageMemory(
        params=params,
        grads=grads,
        optimizer=optimizer,
        host=host,
        saved=np.where(full, 0.0, kept * moe_blocks * micro_batches),
        recompute_peak=np.where(full, kept, 0.0),
        buffers=dispatch_buffer_bytes(model, p, seq_len, d, load),
    )


def forward_s(
    model: ModelSpec,
    p: PlanTable,
    seq_len: int,
    moe_blocks: Num,
    gpu: GPUSpec,
    gemm_peak: Num,
    gemm_d: Num,
    imbalance: float,
    elementwise_scale: float = 1.0,
) -> np.ndarray:
    """Expert compute of one micro-batch's forward through `moe_blocks` MoE blocks: the local experts'
    GEMMs, the router and the permutation, the experts' activation function and, in FP8, the casts of
    their GEMMs' inputs (the token exchange: costmodel/expert_exchange.py); the passes over HBM ×
    `elementwise_scale`, as the dense blocks' are. Zeros for a dense model."""
    if model.moe is None:
        return np.zeros(len(p))
    load = load_factor(model, p, imbalance)
    d = mem.activation_bytes_per_element(p.precision)
    gemms = expert_gemm_time_forward_s(model, p, seq_len, gpu, gemm_peak, gemm_d, load)
    router = router_and_permute_time_forward_s(model, p, seq_len, gpu, gemm_peak, d, load, elementwise_scale)
    passes = activation_time_forward_s(model, p, seq_len, gpu, d, load)
    passes = passes + fp8_cast_time_forward_s(model, p, seq_len, gpu, load)
    return np.asarray((gemms + router + elementwise_scale * passes) * moe_blocks, dtype=float)
