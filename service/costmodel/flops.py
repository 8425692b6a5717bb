"""FLOP counts. Training = forward + backward = 3 × forward for matmuls (Kaplan et al. 2020, §2.1)."""

from __future__ import annotations

import numpy as np

from service.costmodel.types import Num
from service.spec.model import ModelSpec


def matmul_params(model: ModelSpec) -> int:
    """Parameters a token's matmuls use: every block's matrices and the output projection (embedding
    lookups and norms do no matmul work). In a MoE model, the router, the shared experts and the token's
    top-k routed experts: its active matrices (Fedus et al. 2021, Switch Transformer §2: FLOPs per token
    follow the active parameters)."""
    dense = model.dense_view()
    per_layer = dense.attention_params_per_layer + dense.mlp_params_per_layer
    routed = 0
    if model.moe is not None:
        per_expert = model.expert_params_per_moe_layer // model.moe.num_experts
        routed = model.num_moe_layers * model.moe.experts_per_token * per_expert
    return model.num_layers * per_layer + routed + model.vocab_size * model.hidden_size


def model_flops_per_token(model: ModelSpec, seq_len: Num | int) -> Num:
    """Model FLOPs per trained token, the numerator of MFU: 6·N_matmul + 12·L·h·s (N_matmul: the active
    matrices, `matmul_params`).

    The PaLM convention (Chowdhery et al. 2022, Appendix B): 6N for the matmuls of forward and backward,
    plus 12·L·h·s for the attention scores and their product with V, counted without causal masking
    and without recompute. Q·Kᵀ contracts the heads' query/key width and P·V yields their value width, so
    2h is `q_width + attention_out_width` where heads are not h / a wide (Qwen3's head_dim, MLA's 192 and
    128): 6·L·s·(q_width + attention_out_width).
    """
    widths = model.q_width + model.attention_out_width
    attention = 6 * model.num_layers * widths * np.asarray(seq_len, dtype=float)
    return 6.0 * matmul_params(model) + attention


def attention_core_flops_forward(model: ModelSpec, tokens: Num, seq_len: int, tp: Num) -> Num:
    """Forward FLOPs of Q·Kᵀ and P·V for one layer, per TP rank, with causal masking skipping half:
    2 matmuls × 2·s·h FLOPs per token / 2 (Dao 2023, FlashAttention-2, §4 benchmark FLOP count), with
    2h = `q_width + attention_out_width` (see `model_flops_per_token`)."""
    return tokens * seq_len * (model.q_width + model.attention_out_width) / tp
