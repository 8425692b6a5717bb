"""How a MoE block's tokens travel to their experts and back, one function per mechanism: NCCL's
all-to-all of every routed copy, DeepEP's once-per-node exchange with NVLink forwarding, the nodes a
token's routes reach under group-limited routing, and expert tensor parallelism's gather. The layout and
token counts are costmodel/moe.py's.
"""

from __future__ import annotations

import numpy as np

from service.costmodel import comm
from service.costmodel import memory as mem
from service.costmodel.moe import ep_stride, gather_group, load_factor, tokens_dispatched
from service.costmodel.types import Num
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable


def all_to_all_time_s(
    message_bytes: Num,
    group_size: Num,
    stride: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
    nic_efficiency: float,
) -> np.ndarray:
    """One all-to-all in which each rank sends `message_bytes` spread evenly over the group: the share
    bound for its node's other members goes over NVLink, the rest through the rank's own NIC (one per GPU
    on DGX-class nodes) at `nic_efficiency` of its line rate (ModelParams `all_to_all_efficiency`), both
    at once; the slower sets the time (nccl-tests' alltoall bus bandwidth, (n−1)/n of the message). Plus
    NCCL's ring latency of n − 1 steps."""
    n = np.asarray(group_size, dtype=float)
    per_node = ranks_per_node(n, stride, gpus_per_node)
    inside = message_bytes * (per_node - 1) / n
    outside = message_bytes * (n - per_node) / n
    return _exchange_s(inside, outside, n, stride, gpus_per_node, gpu, links, nic_efficiency)


def ranks_per_node(group_size: Num, stride: Num, gpus_per_node: int) -> np.ndarray:
    """Members of a group of `group_size` ranks `stride` apart that share one node."""
    n = np.asarray(group_size, dtype=float)
    return np.minimum(np.clip(gpus_per_node // np.maximum(stride, 1), 1, None), n)


def _exchange_s(
    inside_bytes: Num,
    outside_bytes: Num,
    group_size: Num,
    stride: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
    nic_efficiency: float,
) -> np.ndarray:
    """A rank's exchange of `inside_bytes` over NVLink and `outside_bytes` through its own NIC (one per
    GPU on DGX-class nodes) at `nic_efficiency` of its line rate, both at once: the slower sets the
    time, plus NCCL's ring latency of n − 1 steps; nothing for a group of one."""
    n = np.asarray(group_size, dtype=float)
    nvlink = gpu.intra_node_bandwidth_gb_per_s * 1e9 * links.intra_efficiency
    nic = gpu.inter_node_bandwidth_gb_per_s * 1e9 * nic_efficiency
    latency = comm.ring_latency_s(n, stride, gpus_per_node, gpu, 1, links)
    return np.where(n > 1, np.maximum(inside_bytes / nvlink, outside_bytes / nic) + latency, 0.0)


def nodes_per_token(model: ModelSpec, nodes: Num) -> np.ndarray:
    """Expected distinct nodes, of the `nodes` an EP group spans, that one token's k routes reach.

    Experts are laid out in order over the EP ranks (rank r holds experts r·E/ep to (r + 1)·E/ep − 1,
    Megatron-Core and DeepSeek alike), so each node holds E/N of them; k routes spread evenly over the
    experts reach N·(1 − (1 − 1/N)^k) nodes (routes taken as independent: a slight overcount of sampling
    without replacement). Group-limited routing (`MoESpec.groups_per_token` of `expert_groups` groups of
    consecutive experts) caps that at groups_per_token × ⌈N / groups⌉ nodes: DeepSeek-V3's 4 of 8
    groups on 8 nodes, "each token will be sent to at most 4 nodes" (arXiv 2412.19437 §2.1.2)."""
    moe = model.moe
    assert moe is not None
    n = np.maximum(np.asarray(nodes, dtype=float), 1.0)
    reached = n * (1.0 - (1.0 - 1.0 / n) ** moe.experts_per_token)
    if moe.groups_per_token is None:
        return reached
    cap = moe.groups_per_token * np.ceil(n / moe.expert_groups)
    return np.minimum(reached, cap)


def deepep_time_s(
    model: ModelSpec,
    p: PlanTable,
    tokens: Num,
    d: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
    load: Num,
    nic_efficiency: float,
) -> np.ndarray:
    """One dispatch or combine as DeepEP moves it (deepseek-ai/DeepEP; DeepSeek-V3 §3.2.2): each token
    crosses the network once per remote node its experts are on (`nodes_per_token`, the token's own
    node among them as often as any other) to the GPU of the same local rank there, which forwards it
    over NVLink to the experts' GPUs; routes inside the own node go over NVLink directly. Network and
    NVLink traffic overlap; the slower sets the time, plus the same per-step latency as an all-to-all."""
    h = model.hidden_size
    n = np.asarray(p.ep, dtype=float)
    stride = ep_stride(p)
    per_node = ranks_per_node(n, stride, gpus_per_node)
    nodes = n / per_node
    remote_nodes = nodes_per_token(model, nodes) * (nodes - 1) / nodes
    outside = tokens * load * remote_nodes * h * d
    copies = tokens * model.moe.experts_per_token * load * h * d  # type: ignore[union-attr]
    # to the own node's other GPUs, and the remote copies forwarded inside the nodes that received them
    inside = copies * (per_node - 1) / n + copies * (n - per_node) / n * (per_node - 1) / per_node
    return _exchange_s(inside, outside, n, stride, gpus_per_node, gpu, links, nic_efficiency)


def dispatch_combine_time_s(
    model: ModelSpec,
    p: PlanTable,
    seq_len: int,
    d: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
    load: Num,
    nic_efficiency: float,
    dispatcher: str = "alltoall",
) -> np.ndarray:
    """One pass (forward, or backward) of a MoE block's token exchange: the dispatch and the combine
    all-to-all over the EP group, each moving the rank's k routed copies of its tokens (× the load
    factor: the busiest rank receives the most), and with expert_tp > 1 the all-gather of the received
    tokens over the expert-TP group and the reduce-scatter of the outputs (Megatron-Core's
    AllGather after the all-to-all, token_dispatcher.py MoEAlltoAllTokenDispatcher). Megatron plans
    with `dispatcher` deepep or hybridep (Workload.moe_dispatcher) send each token once per remote node
    (`deepep_time_s`)."""
    moe = model.moe
    assert moe is not None
    tokens = tokens_dispatched(p, seq_len)
    copies = tokens * moe.experts_per_token * load
    message = copies * model.hidden_size * d
    a2a = all_to_all_time_s(message, p.ep, ep_stride(p), gpus_per_node, gpu, links, nic_efficiency)
    if dispatcher in DISPATCHER_SMS:
        deepep = deepep_time_s(model, p, tokens, d, gpus_per_node, gpu, links, load, nic_efficiency)
        a2a = np.where(p.engine_column("transformer_engine"), deepep, a2a)
    group = gather_group(p)
    gather = comm.all_gather_time_s(message * group, group, 1, gpus_per_node, gpu, 1.0, links)
    return np.asarray(2.0 * (a2a + gather), dtype=float)


def forward_s(
    model: ModelSpec,
    p: PlanTable,
    seq_len: int,
    moe_blocks: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
    imbalance: float,
    nic_efficiency: float,
    dispatcher: str = "alltoall",
) -> np.ndarray:
    """The token exchange of one micro-batch's forward through `moe_blocks` MoE blocks (one dispatch and
    one combine each); zeros for a dense model."""
    if model.moe is None:
        return np.zeros(len(p))
    load = load_factor(model, p, imbalance)
    d = mem.activation_bytes_per_element(p.precision)
    one = dispatch_combine_time_s(
        model, p, seq_len, d, gpus_per_node, gpu, links, load, nic_efficiency, dispatcher
    )
    return np.asarray(one * moe_blocks, dtype=float)


# SMs a per-node dispatcher's kernels hold while they run (Workload.moe_dispatcher). DeepEP's normal
# (training) kernels: `Buffer.num_sms` (deep_ep/buffer.py, 20 by default; Megatron-Core's
# moe_flex_dispatcher_num_sms None keeps it); DeepSeek-V3 §3.2.2: "only 20 SMs are sufficient to fully
# utilize the bandwidths of IB and NVLink", of an H800's 132 (§3.5.1). HybridEP: the 32 that
# Megatron-Bridge's performance recipes set (`moe_hybridep_num_sms = 32`; its Qwen3-30B-A3B tuning notes
# "HybridEP with 32 SMs").
DEEPEP_SMS = 20
DISPATCHER_SMS = {"deepep": DEEPEP_SMS, "hybridep": 32}


def overlap_contention(p: PlanTable, dispatcher: str, gpu: GPUSpec, contention: float) -> np.ndarray:
    """Compute lost per second of an exchange hidden behind it (comm.overlapped_exposed_s): DeepEP's and
    HybridEP's kernels hold DISPATCHER_SMS of the GPU's SMs for as long as they run, so the compute beside
    them runs on the rest: SMs / sm_count (DeepEP's 20 of 132 on Hopper: 0.15) where the plan's dispatcher
    is one of them (Megatron plans, `Workload.moe_dispatcher`) and the catalog counts the SMs; NCCL's
    `contention` (fitted on dense overlap) otherwise, and never less than it."""
    sms = DISPATCHER_SMS.get(dispatcher, 0)
    per_node = p.engine_column("transformer_engine") & (sms > 0)
    share = sms / gpu.sm_count if gpu.sm_count else 0.0
    return np.where(per_node, max(contention, share), contention)


def overlap_paired_share(pp: Num, virtual_stages: Num, grad_accum: Num) -> np.ndarray:
    """Share of a step's forward (and backward) chunk passes that Megatron-Core's 1F1B all-to-all overlap
    pairs, on the first pipeline stage. Only the steady state runs a forward beside a backward; the
    warm-up's forwards and the cool-down's backwards run alone. The first stage warms up with
    2(pp − 1) + (v − 1)·pp chunk forwards (the interleaved schedule, micro-batch groups of pp), plus one
    when the overlap is on, "to ensure the forward and backward computations are independent in all 1f1b
    steps" (megatron/core/pipeline_parallel/schedules.py `get_pp_rank_microbatches`; Megatron-Core needs
    virtual stages for the overlap with a pipeline, so pp > 1 with v = 1 is read as 1F1B's pp − 1 plus
    one). Without a pipeline the first forward and the last backward run alone. Of ga·v chunk passes,
    (ga·v − warm-up)/(ga·v) pair, none when the warm-up takes them all."""
    pp_a, v_a = np.asarray(pp, dtype=float), np.asarray(virtual_stages, dtype=float)
    total = np.asarray(grad_accum, dtype=float) * v_a
    interleaved = 2 * (pp_a - 1) + (v_a - 1) * pp_a + 1
    warmup = np.where(pp_a == 1, 1.0, np.where(v_a > 1, interleaved, pp_a))
    return np.asarray(np.clip((total - warmup) / total, 0.0, 1.0), dtype=float)


def paired_exposed_s(
    a2a_s: Num,
    exchange_s: Num,
    attention_fwd_s: Num,
    attention_bwd_s: Num,
    experts_fwd_s: Num,
    moe_blocks: Num,
    paired_share: Num,
    contention: Num,
) -> np.ndarray:
    """A micro-batch's exposed all-to-all under Megatron-Core's 1F1B overlap (Plan.ep_comm_overlap), which
    runs one micro-batch's forward through a block beside another's backward through a block, in three
    phases on two streams (Megatron-LM models/common/model_chunk_schedule_plan.py,
    `TransformerLayerSchedulePlan.run`):

        comm: combine_bwd | dispatch_fwd -> dispatch_bwd     | combine_fwd
        comp: attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | attn_bwd

    Each phase ends when both streams have; inside the middle one, dispatch_bwd waits for mlp_bwd's
    output and mlp_fwd for dispatch_fwd's. So an all-to-all hides only behind the compute it is paired
    with: a block whose attention is short leaves its combines exposed however long its experts run.
    Per MoE block: one dispatch or combine takes `exchange_s` (C = D), its expert forward M (`experts_fwd_s`;
    dgrad and wgrad M each, with --delay-wgrad-compute), its attention side A_f and A_b (`attention_fwd_s`,
    `attention_bwd_s`: the rest of the block, forward and backward); what runs beside an all-to-all loses
    `contention` of the overlap (`overlap_contention`), as the other overlapped collectives do
    (comm.overlapped_exposed_s). `paired_share` of the passes pair (`overlap_paired_share`: the pipeline's
    warm-up forwards and cool-down backwards run alone); their all-to-alls, and any beyond the four per
    block (`a2a_s` is the micro-batch's whole exchange: a fully recomputed forward's too), are exposed."""
    x, m = np.asarray(exchange_s, dtype=float), np.asarray(experts_fwd_s, dtype=float)
    a_f, a_b = np.asarray(attention_fwd_s, dtype=float), np.asarray(attention_bwd_s, dtype=float)
    middle = np.maximum(np.maximum(x, m) + x, np.maximum(2 * m, x) + m)
    pair = np.maximum(x, a_f) + middle + np.maximum(x, a_b)
    exposed = pair - (a_f + a_b + 3 * m)
    hidden = np.maximum(4 * x - exposed, 0.0)
    overlapped = moe_blocks * (exposed + contention * hidden)
    rest = np.asarray(a2a_s, dtype=float) - moe_blocks * 4 * x
    paired = np.asarray(paired_share, dtype=float)
    alone = np.asarray(a2a_s, dtype=float)
    return np.asarray(paired * (overlapped + rest) + (1 - paired) * alone, dtype=float)
