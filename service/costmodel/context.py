"""Context parallelism: the sequence of each micro-batch split over `cp` ranks.

Each rank keeps tokens = micro_batch · seq_len / cp, so its matmuls, saved activations and TP / PP
messages shrink by cp (Megatron-Core docs, "Context parallelism": "activation memory per GPU is CP
times smaller"); attention still relates every token to the whole sequence, so its causal FLOPs per
rank are 1/cp of the sequence's (load-balanced chunks). What the split costs depends on the engine's
style (its `context_parallel` rule, service/catalog/engines/):

* Ulysses (DeepSpeed; Jacobs et al. 2023, arXiv 2309.14509, §3.1-3.2): before attention an all-to-all
  turns the sequence shard of q, k and v into a head shard, after it one turns the output back: four
  all-to-alls per layer in forward and four in backward, each moving (cp − 1)/cp of the rank's buffer
  (the paper's "4Nh/P per link" with GQA's smaller k and v). They sit on the critical path.
* Ring (Megatron-Core CP, torchtitan; Liu et al. 2023, Ring Attention, arXiv 2310.01889, §3): cp − 1
  point-to-point passes of the local K and V chunk per layer, each overlapped with the attention of the
  chunk already held; backward passes K, V and their gradients. Only what a pass takes beyond that
  block of attention is exposed.

Ranks are laid out tp, cp, dp, pp from fastest (Megatron-Core's default order "tp-cp-ep-dp-pp"), so a
CP group has stride tp. ZeRO (DeepSpeed's sequence-data-parallel group), the distributed optimizer
(Megatron's data-parallel group "with context parallel") and FSDP2 (torchtitan's dp_shard_cp mesh)
all shard and reduce over the dp·cp ranks, a group of stride tp.
"""

from __future__ import annotations

import numpy as np

from service.costmodel import comm
from service.costmodel.types import Num
from service.spec.engine import engine_rules
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import ENGINE_CODES, PlanTable

RING = np.array([engine_rules(e).context_parallel.style == "ring" for e in ENGINE_CODES])


def is_ring(engine: Num) -> np.ndarray:
    """Per plan, whether its engine's context parallelism is ring attention (else Ulysses)."""
    return RING[np.asarray(engine, dtype=np.int64)]


def qkvo_bytes(model: ModelSpec, tokens: Num, tp: Num, d: Num) -> Num:
    """One rank's q, k, v and attention output for `tokens` local tokens, per TP rank: the query, key and
    value widths and the output's (2h + 2·kv with h / heads-wide heads; ModelSpec's widths otherwise)."""
    widths = model.q_width + model.kv_width + model.attention_out_width
    return tokens * widths / tp * d


def kv_chunk_bytes(model: ModelSpec, tokens: Num, tp: Num, d: Num) -> Num:
    """The K and V of `tokens` local tokens on one TP rank, the message of one ring pass."""
    return tokens * model.kv_width / tp * d


def ulysses_time_per_layer_s(
    model: ModelSpec,
    tokens: Num,
    tp: Num,
    cp: Num,
    d: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
) -> Num:
    """Forward all-to-alls of one layer (backward moves the same again): q, k, v in, the output out;
    each sends (cp − 1)/cp of its buffer, the bandwidth term of an all-gather of that buffer."""
    return comm.all_gather_time_s(qkvo_bytes(model, tokens, tp, d), cp, tp, gpus_per_node, gpu, 4.0, links)


def ring_exposed_per_layer_s(
    model: ModelSpec,
    tokens: Num,
    tp: Num,
    cp: Num,
    d: Num,
    attention_s: Num,
    messages: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
) -> Num:
    """Exposed time of one layer's cp − 1 ring passes of `messages` K/V-sized chunks each (1 forward:
    K, V; 2 backward: K, V and dK, dV), each hidden behind 1/cp of the layer's `attention_s`."""
    crosses = tp * cp > gpus_per_node
    one_pass = messages * comm.p2p_time_s(kv_chunk_bytes(model, tokens, tp, d), crosses, gpu, links)
    return (cp - 1) * np.maximum(0.0, one_pass - attention_s / cp)


def ulysses_saved_bytes_per_token_per_layer(model: ModelSpec, tp: Num, cp: Num, engine: Num, d: Num) -> Num:
    """Bytes per local token per layer that Ulysses attention saves for backward beyond the unsplit
    block (`service.costmodel.memory.activation_bytes_per_token_per_layer`), on one TP rank.

    DeepSpeed's `_SeqAllToAll` (deepspeed/sequence/layer.py, 0.19.8) saves no tensor, but its output
    all-to-all returns a new tensor, the o_proj input (d·h/t), while the attention kernel keeps its own
    output in the head layout: without cp the two share storage, with cp both are saved. And the
    all-to-all needs at least one KV head per rank (`_resolve_kv_heads` asserts it), so when the
    rank's kv/t heads are fewer than cp they are repeated up to cp (as Megatron repeats KV heads when
    t exceeds the groups; the proxy's `_repeat_kv_heads`), and attention saves k and v of the
    repeated heads: 2·d·(cp − kv/t)·head_dim more. Ring attention (megatron, fsdp) adds neither.
    """
    kv_per_rank = model.kv_heads / tp
    repeated = np.maximum(kv_per_rank, cp) - kv_per_rank
    extra = d * (model.attention_out_width / tp + repeated * (model.head_dim + model.v_head_dim))
    return np.where((cp > 1) & ~is_ring(engine), extra, 0.0)


def buffer_bytes(model: ModelSpec, tokens: Num, tp: Num, cp: Num, engine: Num, d: Num) -> Num:
    """Transient device memory of the split: Ulysses' all-to-all output of q, k, v and o (the size of
    its input); ring attention's two K/V receive buffers (double-buffered passes)."""
    ring = 2 * kv_chunk_bytes(model, tokens, tp, d)
    ulysses = qkvo_bytes(model, tokens, tp, d)
    return np.where(cp > 1, np.where(is_ring(engine), ring, ulysses), 0.0)


def exposed_per_layer_s(
    model: ModelSpec,
    p: PlanTable,
    tokens: Num,
    d: Num,
    attention_layer: Num,
    attention_backward_ratio: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
) -> np.ndarray:
    """Exposed context-parallel communication of one layer and one micro-batch, forward, backward and
    a fully recomputed forward: Ulysses all-to-alls, or ring passes hidden behind the attention
    (`attention_layer` forward, `attention_backward_ratio` × it backward)."""
    forwards = 1 + (p.recompute == 2)
    ulysses = ulysses_time_per_layer_s(model, tokens, p.tp, p.cp, d, gpus_per_node, gpu, links) * (
        forwards + 1
    )
    backward = attention_backward_ratio * attention_layer
    ring = forwards * ring_exposed_per_layer_s(
        model, tokens, p.tp, p.cp, d, attention_layer, 1, gpus_per_node, gpu, links
    ) + ring_exposed_per_layer_s(model, tokens, p.tp, p.cp, d, backward, 2, gpus_per_node, gpu, links)
    return np.where(p.cp > 1, np.where(is_ring(p.engine), ring, ulysses), 0.0)
