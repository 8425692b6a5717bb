"""Time of the math on one GPU: matmuls on a roofline with a tile-fill efficiency, fused attention at
its kernel efficiency, and element-wise ops at memory bandwidth. Inputs are numpy arrays (one per plan).

Efficiency priors come from the GPU catalog (`gemm_efficiency_max`, `attention_efficiency`: kernel
benchmarks, cited per GPU) and from tile geometry below, never from fitting training runs.
"""

from __future__ import annotations

import numpy as np

from service.costmodel.flops import attention_core_flops_forward
from service.costmodel.types import Num
from service.spec.attention import Projection
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec

# A GEMM dimension of TILE_HALF_FILL elements fills half of a typical tensor-core tile (128-256 wide on
# A100/H100, CUTLASS defaults), so efficiency scales as x/(x+64) per dimension: ~0.98 at 4096, 0.67 at 128.
TILE_HALF_FILL = 64.0
# FlashAttention reaches its asymptotic rate only for long sequences; at s = 384 about half of it
# (FlashAttention-2 paper, Fig. 4-5: ~0.55 of the 16k rate at 512, ~0.9 at 4k).
ATTENTION_HALF_SEQ = 384.0
# Backward of flash attention is 2.5× its forward FLOPs (it recomputes the scores; FA2 benchmark count).
ATTENTION_BACKWARD_RATIO = 2.5
# Element-wise traffic per token per block in a Hugging Face Llama layer without fused kernels, in units
# of one activation (bytes / d): RMSNorms ~2×(read x, fp32 cast, square, mean, scale, cast back,
# weight) ≈ 2×17h,
# rotary ≈ 6 passes over q and k, SiLU·up ≈ 5 passes over f, residual adds and layout copies ≈ 10h.
# With fused kernels (Apex/Transformer Engine fused RMSNorm/LayerNorm, fused rotary, fused bias-SwiGLU or
# bias-GeLU, fused bias-dropout-add: Megatron-LM's megatron/core/fusions; Liger; torch.compile) each op
# reads its inputs and writes its output once: norms 2×2h, residual adds 2×3h, rotary 2·(q + k), the
# gated MLP 3f (gate and up in, one out; 2f without a gate).
# Backward moves about twice the forward traffic.
ELEMENTWISE_BACKWARD_RATIO = 2.0
# Kernels launched per block in forward (HF eager modules: norms, 7 matmuls, rotary, SDPA, SiLU, adds).
KERNELS_PER_LAYER_FORWARD = 40


def gemm_time_s(m: Num, n: Num, k: Num, gpu: GPUSpec, peak_flops: Num, d: Num) -> Num:
    """Seconds for an (m×k)·(k×n) matmul: the larger of compute time at a tile-fill efficiency and the
    time to move its operands through HBM (the roofline model, Williams et al. 2009)."""
    fill = (m / (m + TILE_HALF_FILL)) * (n / (n + TILE_HALF_FILL)) * (k / (k + TILE_HALF_FILL))
    compute = 2.0 * m * n * k / (peak_flops * gpu.gemm_efficiency_max * fill)
    memory = d * (m * k + k * n + m * n) / (gpu.hbm_bandwidth_gb_per_s * 1e9)
    return np.maximum(compute, memory)


def attention_gemm_time_forward_s(
    model: ModelSpec, tokens: Num, tp: Num, gpu: GPUSpec, peak_flops: Num, d: Num
) -> Num:
    """Forward QKV and output projections of one block on one TP rank: QKV column-parallel (split n),
    output row-parallel (split k) (Megatron-LM §3). Widths are the heads' (`ModelSpec.q_width`,
    `kv_width`, `attention_out_width`: hidden_size when head_dim = h / heads). Multi-head latent attention
    runs its projections one by one (`ModelSpec.attention_projections`), its down-projections whole on
    every rank."""
    if model.mla is not None:
        return sum(_projection_time_s(p, tokens, tp, gpu, peak_flops, d) for p in model.attention_projections)
    h = model.hidden_size
    qkv = gemm_time_s(tokens, (model.q_width + model.kv_width) / tp, h, gpu, peak_flops, d)
    return qkv + gemm_time_s(tokens, h, model.attention_out_width / tp, gpu, peak_flops, d)


def _projection_time_s(p: Projection, tokens: Num, tp: Num, gpu: GPUSpec, peak_flops: Num, d: Num) -> Num:
    """One weight matrix's forward GEMM on one TP rank: column-parallel splits its outputs, row-parallel
    its inputs, a replicated one runs whole."""
    n = p.out_features / tp if p.split == "column" else p.out_features
    k = p.in_features / tp if p.split == "row" else p.in_features
    return gemm_time_s(tokens, n, k, gpu, peak_flops, d)


def layer_gemm_time_forward_s(
    model: ModelSpec, tokens: Num, tp: Num, gpu: GPUSpec, peak_flops: Num, d: Num
) -> Num:
    """Forward matmuls of one block on one TP rank: the attention projections plus the MLP's in (gate
    and up fused for swiglu, column-parallel) and out (row-parallel)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    mlp_in = f * (2 if model.mlp == "swiglu" else 1)
    attention = attention_gemm_time_forward_s(model, tokens, tp, gpu, peak_flops, d)
    mlp = gemm_time_s(tokens, mlp_in / tp, h, gpu, peak_flops, d) + gemm_time_s(
        tokens, h, f / tp, gpu, peak_flops, d
    )
    return attention + mlp


def attention_time_forward_s(
    model: ModelSpec,
    tokens: Num,
    seq_len: int,
    tp: Num,
    gpu: GPUSpec,
    peak_flops: Num,
    d: Num,
    flash: bool = True,
    kernel_seq_len: Num | None = None,
) -> Num:
    """Forward of causal attention for one block on one TP rank.

    Flash: the causal FLOPs at the kernel's efficiency, which grows with the key length one kernel call
    sees (`kernel_seq_len`, default `seq_len`; ring attention's calls see s/cp).
    Materialised (Megatron-LM 2021-22): the full s×s score and context matmuls as batched GEMMs, plus
    the fused scale-mask-softmax and dropout passes over the scores (read and write 2 bytes, and a
    1-byte mask: ~10·a·s bytes per token in 16-bit).
    """
    if flash:
        keys = seq_len if kernel_seq_len is None else kernel_seq_len
        efficiency = gpu.attention_efficiency * keys / (keys + ATTENTION_HALF_SEQ)
        return attention_core_flops_forward(model, tokens, seq_len, tp) / (peak_flops * efficiency)
    heads = model.num_attention_heads / tp
    batches = tokens / seq_len * heads
    s = np.asarray(float(seq_len))
    # Q·Kᵀ contracts the query/key head width, P·V yields the value width (they differ under MLA).
    scores_gemm = gemm_time_s(s, seq_len, model.head_dim, gpu, peak_flops, d)
    context_gemm = gemm_time_s(s, seq_len, model.v_head_dim, gpu, peak_flops, d)
    bmm = batches * (scores_gemm + context_gemm)
    scores = tokens * 10 * heads * seq_len * d / 2 / (gpu.hbm_bandwidth_gb_per_s * 1e9)
    return bmm + scores


def elementwise_bytes_per_token_forward(model: ModelSpec, tp: Num, d: Num, fused: Num = False) -> Num:
    """HBM bytes the non-matmul ops of one block move per token in forward, as eager PyTorch modules or
    as fused kernels (see the constants above). Rotary turns `ModelSpec.rotary_width` features (q and k;
    MLA's rope part); MLA's two latent RMSNorms count as the block's norms do, per element, whole on
    every rank."""
    h, f, rotary = model.hidden_size, model.ffn_hidden_size, model.rotary_width
    latent = model.latent_norm_width
    gated = model.mlp == "swiglu"
    eager = 2 * 17 * h + 17 * latent + 10 * h + (6 * 2 * rotary + 5 * f * (2 if gated else 1) / 2) / tp
    one_pass = 2 * 2 * h + 2 * latent + 2 * 3 * h + (2 * rotary + (3 if gated else 2) * f) / tp
    return d * np.where(fused, one_pass, eager)


def elementwise_time_forward_s(
    model: ModelSpec, tokens: Num, tp: Num, gpu: GPUSpec, d: Num, fused: Num = False
) -> Num:
    bytes_per_token = elementwise_bytes_per_token_forward(model, tp, d, fused)
    return tokens * bytes_per_token / (gpu.hbm_bandwidth_gb_per_s * 1e9)


def launch_bound_s(gpu: GPUSpec, kernels: float | np.ndarray) -> Num:
    """Host time to launch `kernels` kernels; the GPU cannot finish a block faster than this."""
    return np.asarray(kernels, dtype=float) * gpu.kernel_overhead_us * 1e-6


# Megatron-Core's CUDA-graph regions (Workload.cuda_graph_scope) that replay a MoE block's router and
# dispatcher preprocessing, the host-heavy part of its pass, from a graph.
MOE_HOST_GRAPHED = ("moe_preprocess", "moe", "full_iteration")


def moe_host_floor_s(
    moe_blocks: Num,
    host_s_per_block: float,
    host_s_per_expert: Num,
    local_experts: Num,
    graphs_possible: np.ndarray,
    scope: tuple[str, ...],
) -> np.ndarray:
    """Least time one micro-batch's forward and backward through `moe_blocks` MoE blocks takes: the host
    time of each block pass (ModelParams moe_block_host_s) and `host_s_per_expert` for each of its
    `local_experts` (the engine's `ExpertParallelRule.host_s_per_local_expert`). A MoE block's router and
    dispatcher preprocessing run as many small eager ops, its experts launch a GEMM each (Transformer
    Engine's GroupedLinear from C++; DeepSpeed's experts loop a module call each, its measured cost), and
    the dispatcher copies the tokens per expert to the host to size the exchange and the expert GEMMs
    (Megatron-Core token_dispatcher.py, DeepSpeed sharded_moe.py `exp_counts`, torchtitan's all-to-all
    splits), so the host cannot run a block ahead and a pass whose GPU work is shorter waits for it.
    NVIDIA names it one of MoE training's three walls, "small expert GEMMs + host overhead", cut by fewer
    launches (lower TP, larger micro-batches) or CUDA graphs (Megatron-Bridge
    docs/training/moe-optimization.md). Where a plan can replay the router and preprocessing from graphs
    (`graphs_possible`: Megatron-Core's Transformer Engine capture) and `scope` does, no floor is
    priced: the published runs with them were GPU-bound."""
    graphed = graphs_possible & any(s in MOE_HOST_GRAPHED for s in scope)
    per_block = host_s_per_block + np.asarray(host_s_per_expert) * np.asarray(local_experts)
    return np.asarray(np.where(graphed, 0.0, np.asarray(moe_blocks) * per_block), dtype=float)


def lm_head_time_forward_s(
    model: ModelSpec, tokens: Num, tp: Num, gpu: GPUSpec, peak_flops: Num, d: Num
) -> Num:
    """Output projection (vocab split by tp) plus the log-softmax over V in fp32 (memory-bound)."""
    gemm = gemm_time_s(tokens, model.vocab_size / tp, model.hidden_size, gpu, peak_flops, d)
    softmax = tokens * model.vocab_size / tp * (d + 3 * 4) / (gpu.hbm_bandwidth_gb_per_s * 1e9)
    return gemm + softmax


def optimizer_step_time_s(params_updated: Num, gpu: GPUSpec) -> Num:
    """Adam on the GPU is memory-bound: read grad, master, m, v and write master, m, v, param:
    about 2 + 3×4 + 3×4 + 2 = 28 bytes per parameter (fused multi-tensor Adam, one pass)."""
    return params_updated * 28.0 / (gpu.hbm_bandwidth_gb_per_s * 1e9)
