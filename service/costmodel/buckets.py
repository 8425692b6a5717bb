"""How many collectives DeepSpeed's ZeRO 0-2 gradient reduction issues per step.

DeepSpeed fills an "IPG" bucket with gradients as backward produces them and reduces it when the next
gradient would overflow `reduce_bucket_size` (deepspeed/runtime/zero/stage_1_and_2.py,
`reduce_independent_p_g_buckets_and_remove_grads`: `if self.elements_in_ipg_bucket + param.numel() >
self.reduce_bucket_size: self.reduce_ipg_grads()`), and once more at the end of backward. A tensor at
least as large as the bucket is therefore reduced on its own, and small ones share a call: the count is
a greedy packing of the rank's gradient tensors in backward order, not Ψ / bucket. With the bucket of
`ZeroKnobs` (h² elements) a Llama block's q and o projections fill a bucket each, the MLP's three
matrices (h·f/tp > h²) go alone, and k, v and the norms share: about 6 calls per block. Measured on the
4-layer tiny proxy at dp 2 (DeepSpeed 0.19.8, gloo): 30 gradient all-reduces per step; this count
gives 30, Ψ / bucket 53.

The updated parameters come back in one call per parameter group (`all_gather_dp_groups` →
`all_gather_into_tensor_dp_groups`, which ignores `allgather_bucket_size` when the backend has
`all_gather_into_tensor`): PARAM_GATHER_CALLS.
"""

from __future__ import annotations

import functools

import numpy as np

from service.costmodel.memory import stage_layers
from service.costmodel.types import Num, on_distinct
from service.spec.attention import MLASpec
from service.spec.model import ModelSpec

PARAM_GATHER_CALLS = 1.0


def block_tensor_elements(model: ModelSpec, tp: int) -> list[float]:
    """One block's weight tensors on one TP rank, in registration order (Hugging Face Llama: q, k, v, o,
    the MLP's gate and up (swiglu) or in, then out, then the two norms). Multi-head latent attention
    (transformers' `DeepseekV3Attention`) registers each down-projection, whole on every rank, with its
    latent RMSNorm after it."""
    h, f = model.hidden_size, model.ffn_hidden_size
    latent_norms = {} if model.mla is None else _latent_norms(model.mla)
    attention: list[float] = []
    for p in model.attention_projections:
        attention.append(p.elements / tp if p.split != "none" else float(p.elements))
        if p.name in latent_norms:
            attention.append(float(latent_norms[p.name]))
    mlp = [h * f / tp] * (2 if model.mlp == "swiglu" else 1) + [f * h / tp]
    return [*attention, *mlp, float(h), float(h)]


def _latent_norms(mla: MLASpec) -> dict[str, int]:
    """MLA's latent RMSNorms by the projection they follow: q_a_layernorm, kv_a_layernorm."""
    norms = {"kv_a_proj_with_mqa": mla.kv_lora_rank}
    if mla.q_lora_rank is not None:
        norms["q_a_proj"] = mla.q_lora_rank
    return norms


def greedy_calls(tensors: list[float], bucket: float) -> int:
    """Reductions DeepSpeed issues for `tensors` (in the order backward produces them)."""
    calls, filled = 0, 0.0
    for n in tensors:
        if filled > 0 and filled + n > bucket:
            calls, filled = calls + 1, 0.0
        filled += n
    return calls + (filled > 0)


@functools.lru_cache(maxsize=256)
def _reduce_calls(model: ModelSpec, tp: int, pp: int, bucket: float) -> int:
    """Calls on the busiest stage (first or last) of a pipeline of `pp` stages."""
    # Each end stage's blocks as memory.stage_layers lays them out, without interleaving (DeepSpeed runs
    # plain 1F1B): the first stage takes the extra block when pp does not divide the layers.
    first_layers, last_layers = (int(n) for n in stage_layers(model.num_layers, pp))
    per_block = block_tensor_elements(model, tp)
    embedding = [float(model.vocab_size * model.hidden_size)]  # whole on every TP rank (memory.py)
    head = [float(model.hidden_size)] + (
        [] if model.tie_word_embeddings and pp == 1 else [model.vocab_size * model.hidden_size / tp]
    )
    first = embedding + per_block * first_layers + (head if pp == 1 else [])
    last = per_block * last_layers + head
    return max(greedy_calls(first[::-1], bucket), greedy_calls(last[::-1], bucket))


def gradient_reduce_calls(model: ModelSpec, tp: Num, pp: Num, bucket: float) -> np.ndarray:
    """Per plan, the bucket reductions of one step's gradients (see the module docstring)."""

    def per_pair(tps: np.ndarray, pps: np.ndarray) -> np.ndarray:
        pairs = zip(tps.tolist(), pps.tolist(), strict=True)
        return np.array([_reduce_calls(model, t, p, float(bucket)) for t, p in pairs], dtype=float)

    return np.asarray(on_distinct(per_pair, tp, pp), dtype=float)
