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
