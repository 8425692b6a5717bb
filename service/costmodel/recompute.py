"""What selective recompute re-runs and keeps, by what a framework checkpoints (Workload.selective_recompute).

This service's worker checkpoints each block's attention sub-block (train/model.py), and so does the
default. Other frameworks' policies, read from their code, price the published runs that used them:
torchtitan's 'selective op' and 'selective layer' AC (torchtitan parallelize_llama.py) and fms-fsdp's
`selective_checkpointing` (fms_fsdp/policies/ac_handler.py).
"""

from __future__ import annotations

import numpy as np

from service.costmodel.data_parallel import module_elements_per_block
from service.costmodel.memory import FP32
from service.costmodel.types import Num
from service.spec.model import ModelSpec


def selective_recompute_s(
    model: ModelSpec, kind: str, attention_block: Num, full_block: Num, gemm: Num, elementwise: Num
) -> Num:
    """Forward work selective recompute re-runs in backward, by what it checkpoints
    (Workload.selective_recompute; the inputs are a stage's forward times):
      - attention_block: the attention projections and core of every block;
      - every_other_block: all of every second block, ⌊L/2⌋ of L (torchtitan's 'selective layer' AC with
        option 2 wraps blocks 2, 4, …: `_count % ac_freq == 0` in parallelize_llama.py; fms-fsdp's
        `selective_checkpointing` 0.5 wraps blocks 1, 3, …: ac_handler.py `apply_fsdp_checkpointing`);
      - every_other_matmul: torchtitan's 'selective op' AC saves the outputs of matmuls and attention
        (`_save_list`) except every second matmul a block runs (`mm_count % 2 == 0`), so backward re-runs
        every element-wise op and the matmuls in even places: k, o and up of a Llama block (q, k, v, o,
        gate, up, down), the attention output and MLP out of a GPT block. The matmuls share one token
        count, so their time is split by weight elements.
    """
    if kind == "every_other_block":
        return (model.num_layers // 2) / model.num_layers * full_block
    if kind == "every_other_matmul":
        sizes = module_elements_per_block(model)
        share = sum(sizes[1::2]) / sum(sizes)
        return share * gemm + elementwise
    return attention_block


def matmul_output_features(model: ModelSpec, tp: Num, sequence_parallel: Num) -> list[Num]:
    """Output width of each matmul of a block on one TP rank, in the order forward runs them (the order of
    `data_parallel.module_elements_per_block`): column-parallel outputs are split by tp; the row-parallel
    ones (attention output, MLP out) are whole, or split by sequence parallelism's reduce-scatter; MLA's
    down-projections, replicated, are whole."""
    h, f = model.hidden_size, model.ffn_hidden_size
    row = h / np.where(sequence_parallel, tp, 1)
    mlp = [f / tp, f / tp, row] if model.mlp == "swiglu" else [f / tp, row]
    if model.mla is None and model.weight_matrices_per_block != 7:  # GPT style: QKV fused
        return [(model.q_width + model.kv_width) / tp, row, f / tp, row]
    attention = [
        p.out_features / tp if p.split == "column" else row if p.split == "row" else p.out_features
        for p in model.attention_projections
    ]
    return attention + mlp


def selective_bytes_per_token_per_layer(
    model: ModelSpec,
    tp: Num,
    sequence_parallel: Num,
    d: Num,
    kind: str,
    attention_block: Num,
    none: Num,
    full: Num,
) -> Num:
    """Bytes a block keeps for backward under selective recompute, by what it checkpoints
    (Workload.selective_recompute), given the same block's bytes with the attention sub-block
    checkpointed (`attention_block`), with nothing recomputed (`none`) and fully recomputed (`full`):
      - every_other_block: ⌊L/2⌋ blocks keep `full`, the others `none` (the mean per block);
      - every_other_matmul (torchtitan's op policy, see `selective_recompute_s` above):
        the checkpoint keeps the block input and the saved ops' outputs, the matmuls in odd places
        (q, v, gate, down of a Llama block; QKV and MLP in of a GPT block) and attention's output and fp32
        log-sum-exp; every other tensor is made again in backward.
    """
    if kind == "every_other_block":
        kept = model.num_layers // 2
        return (kept * full + (model.num_layers - kept) * none) / model.num_layers
    if kind == "every_other_matmul":
        saved = sum(matmul_output_features(model, tp, sequence_parallel)[0::2])
        attention_out = model.attention_out_width / tp
        block_input = model.hidden_size / np.where(sequence_parallel, tp, 1)
        return d * (block_input + saved + attention_out) + FP32 * model.num_attention_heads / tp
    return attention_block


# Megatron-Core's fine-grained recompute (TransformerConfig.recompute_modules, --recompute-modules with
# --recompute-granularity selective; Megatron-Core MoE README, v0.13): what a megatron plan's selective
# recompute re-runs, by module. "core_attn" alone is Megatron's default, the baseline the TE count
# (`memory.te_layer_bytes_per_token`) and the fit price; the others change it.


def dense_mlp_shares(model: ModelSpec) -> tuple[float, float]:
    """(dense blocks' MLPs, MoE blocks' shared experts and router) as shares of the dense view's MLP
    parameters (`ModelSpec.dense_view`): the parts of its mean MLP that "mlp" and "shared_experts" /
    "moe" recompute. A dense model's MLP is all "mlp"."""
    if model.moe is None:
        return 1.0, 0.0
    dense = (model.num_layers - model.num_moe_layers) * model.mlp_params_per_layer
    shared = model.num_moe_layers * model.shared_params_per_moe_layer
    outside = dense + shared
    return (dense / outside, shared / outside) if outside else (0.0, 0.0)


def megatron_modules_bytes_per_token_per_layer(
    model: ModelSpec,
    modules: tuple[str, ...],
    tp: Num,
    sequence_parallel: Num,
    d: Num,
    g: Num,
    mlp_width: int,
    mlp_recomputed: bool,
) -> Num:
    """Bytes per token one block keeps under `modules`, less what it keeps under "core_attn" alone
    (negative: freed); `g` is the bytes of a saved GEMM input (1 in FP8); `mlp_width` is the block's MLP
    outside the routed experts (a dense block's, or a MoE block's shared experts) and `mlp_recomputed`
    whether `modules` re-make it ("mlp" for a dense block, "shared_experts" or "moe" for a MoE block).
    The output-discarding modules drop the tensor they would re-make: "layernorm" both norms' outputs
    (g·h each), "mla_up_proj" MLA's up-projected q, k and v (d·(q + kv) per TP rank); the checkpointed
    ones keep only their input, which the residual stream keeps anyway: the MLP's fc1 output and fc2
    input. Without "core_attn" the attention's fp32 log-sum-exp stays (`memory.te_layer_bytes_per_token`)."""
    h = model.hidden_size
    split = np.where(sequence_parallel, tp, 1)
    delta = 0.0 if "core_attn" in modules else FP32 * model.num_attention_heads / tp
    if "layernorm" in modules:
        delta = delta - 2 * g * h / split
    if "mla_up_proj" in modules and model.mla is not None:
        delta = delta - d * (model.q_width + model.kv_width) / tp
    gate = 2 if model.mlp == "swiglu" else 1
    return delta - mlp_recomputed * (d * gate + g) * mlp_width / tp


def megatron_modules_recompute_s(
    model: ModelSpec,
    modules: tuple[str, ...],
    attention_block: Num,
    up_projections: Num,
    mlp_gemm: Num,
    norms: Num,
    experts: Num,
    expert_activation: Num,
) -> Num:
    """Forward work Megatron-Core's selective recompute re-runs in backward, by `modules` (the inputs are
    a stage's forward times): "core_attn" as this service prices Megatron's default (`attention_block`,
    see estimate.py), "layernorm" the two norms, "mla_up_proj" MLA's up-projection GEMMs, "mlp" and
    "shared_experts" their shares of the dense view's MLP GEMMs (`dense_mlp_shares`), "moe" the routed
    experts, router and permutation (and the shared experts; its all-to-alls are counted with the other
    all-to-alls), "moe_act" the experts' activation function."""
    dense, shared = dense_mlp_shares(model)
    chosen = set(modules)
    total = attention_block * ("core_attn" in chosen) + norms * ("layernorm" in chosen)
    total = total + up_projections * ("mla_up_proj" in chosen) + dense * ("mlp" in chosen) * mlp_gemm
    total = total + shared * bool({"shared_experts", "moe"} & chosen) * mlp_gemm
    total = total + experts * ("moe" in chosen)
    return total + expert_activation * ("moe_act" in chosen and "moe" not in chosen)
