"""The FLOP counts per token that published sources used to turn their TFLOP/s or MFU into a rate: a
measurement quoted that way is converted back to tokens/s with the source's own formula
(`Measured.flops_formula`), never with this service's count (service/costmodel/flops.py)."""

from __future__ import annotations

from typing import Literal

from service.spec import ModelSpec, SpecError

FlopsFormula = Literal["narayanan2021_eq3", "korthikanti2022_eq7", "megatron_moe"]


def narayanan_eq3_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Narayanan et al. 2021, Eq. 3 divided by B·s: 96·l·h²·(1 + s/(6h) + V/(16·l·h)), recompute included."""
    n_layers, h, v = model.num_layers, model.hidden_size, model.vocab_size
    return 96 * n_layers * h * h * (1 + seq_len / (6 * h) + v / (16 * n_layers * h))


def korthikanti_eq7_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Korthikanti et al. 2022, Eq. 7 divided by B·s: 72·L·h²·(1 + s/(6h) + V/(12·h·L)) model FLOPs."""
    n_layers, h, v = model.num_layers, model.hidden_size, model.vocab_size
    return 72 * n_layers * h * h * (1 + seq_len / (6 * h) + v / (12 * h * n_layers))


def megatron_moe_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Megatron-LM's `num_floating_point_operations` (megatron/training/training.py, the MoE branch that
    Megatron's MoE tables' TFLOP/s use) divided by B·s: 6 × the MLP matrices a token passes (dense
    blocks, its top-k experts, the shared experts), the attention projections with causal scores
    12·L·h²·(1 + kv/heads + s/2h)·(heads·head_dim/h), and 6·h·V for the output layer. Not the MLA
    branch (DeepSeek), which prices attention otherwise."""
    if model.mla is not None:
        raise SpecError(
            "measured.flops_formula", "megatron_moe: Megatron's MLA branch is not implemented here"
        )
    h, layers, matrices = model.hidden_size, model.num_layers, model.mlp_matrices
    moe, n_moe = model.moe, model.num_moe_layers
    mlp = (layers - n_moe) * matrices * h * model.ffn_hidden_size
    if moe is not None:
        mlp += n_moe * matrices * h * (moe.experts_per_token * moe.expert_ffn_hidden_size)
        mlp += n_moe * matrices * h * moe.num_shared_experts * moe.shared_width
    heads = model.num_attention_heads
    attention = 12 * layers * h * h * (1 + model.kv_heads / heads + seq_len / (2 * h)) * model.q_width / h
    return 6.0 * mlp + attention + 6.0 * h * model.vocab_size


FLOPS_PER_TOKEN = {
    "narayanan2021_eq3": narayanan_eq3_flops_per_token,
    "korthikanti2022_eq7": korthikanti_eq7_flops_per_token,
    "megatron_moe": megatron_moe_flops_per_token,
}
