"""Collective communication times from group size, message size and where the group sits.

Ring/tree algorithms as NCCL runs them (Thakur et al. 2005; NCCL docs, "Performance"): an all-reduce
moves 2(n−1)/n of the message through each GPU's link, a reduce-scatter or all-gather (n−1)/n.

Latency follows NCCL's own tuning model (NVIDIA/nccl src/graph/tuning.cc, `ncclTopoTuneModel`): a
ring of n ranks over `nodes` nodes pays a base latency plus one NVLink hop latency for each of its
n − nodes intra-node steps and one network hop latency for each of its nodes − 1 inter-node steps;
the tree all-reduce pays 2·((n/nodes − 1) intra hops + log2(nodes) network hops). Charging every
step at the network's latency (the previous model) made ZeRO-3's per-module gathers on hundreds of
ranks several times too slow.

Placement: ranks are laid out tp fastest, then dp, then pp (Megatron-LM and DeepSpeed's
PipeDataParallelTopology), so a TP group sits inside a node, a DP group spans nodes once tp·dp exceeds
the node, and each pipeline hop crosses nodes once tp·dp fills a node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel.types import Num, on_distinct_ints
from service.spec.hardware import GPUSpec

# Fraction of link bandwidth NCCL collectives sustain on large messages (nccl-tests bus bandwidth vs
# link rate on DGX A100/H100: ~80 %). The calibrated values live in ModelParams.
NCCL_BUS_EFFICIENCY = 0.8
# NCCL's base latency of a ring collective with the Simple protocol used for large messages
# (tuning.cc `baseLat`, Ring/Simple = 8.4 µs).
NCCL_BASE_LATENCY_US = 8.4


@dataclass(frozen=True)
class Links:
    """How well NCCL uses the links: bus efficiency inside and across nodes, and a factor on the hop
    latencies of the GPU catalog (fitted in `ModelParams`; these defaults are the analytical prior)."""

    intra_efficiency: float = NCCL_BUS_EFFICIENCY
    inter_efficiency: float = NCCL_BUS_EFFICIENCY
    latency_scale: float = 1.0


PRIOR = Links()


def group_bus_bandwidth_bytes_per_s(
    group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec, links: Links = PRIOR
) -> Num:
    """Bus bandwidth per GPU of a group of `group_size` ranks spaced `stride` apart.

    Inside one node it is NVLink. Across nodes, NCCL runs one ring per NIC, so the k members a node
    holds share k NICs: min(NVLink, k × NIC) (one NIC per GPU on DGX-class nodes).
    """
    span = group_size * stride
    members_per_node = np.clip(gpus_per_node // np.maximum(stride, 1), 1, None)
    members_per_node = np.minimum(members_per_node, group_size)
    intra = gpu.intra_node_bandwidth_gb_per_s
    inter = np.minimum(intra, members_per_node * gpu.inter_node_bandwidth_gb_per_s)
    inside = span <= gpus_per_node
    efficiency = np.where(inside, links.intra_efficiency, links.inter_efficiency)
    return np.where(inside, intra, inter) * 1e9 * efficiency


def _members_and_nodes(group_size: Num, stride: Num, gpus_per_node: int) -> tuple[Num, Num]:
    """(ranks of the group per node, nodes the group spans) for a group of ranks `stride` apart."""
    n = np.asarray(group_size, dtype=float)
    per_node = np.minimum(np.clip(gpus_per_node // np.maximum(stride, 1), 1, None), n)
    return per_node, np.maximum(1.0, np.ceil(n / per_node))


def ring_latency_s(
    group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec, steps_per_rank: int, links: Links = PRIOR
) -> Num:
    """NCCL's ring latency: base + (steps − inter steps) NVLink hops + inter steps network hops, where a
    reduce-scatter / all-gather has n − 1 steps (nodes − 1 of them between nodes), an all-reduce twice
    that (tuning.cc)."""
    n = np.asarray(group_size, dtype=float)
    _, nodes = _members_and_nodes(n, stride, gpus_per_node)
    steps, inter = steps_per_rank * (n - 1), steps_per_rank * (nodes - 1)
    hops_us = (steps - inter) * gpu.intra_node_latency_us + inter * gpu.inter_node_latency_us
    return links.latency_scale * (NCCL_BASE_LATENCY_US + hops_us) * 1e-6


def tree_latency_s(
    group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec, links: Links = PRIOR
) -> Num:
    """NCCL's tree all-reduce latency: base + 2·((ranks per node − 1) NVLink hops + log2(nodes) network
    hops) (tuning.cc)."""
    per_node, nodes = _members_and_nodes(group_size, stride, gpus_per_node)
    hops_us = (per_node - 1) * gpu.intra_node_latency_us + np.log2(nodes) * gpu.inter_node_latency_us
    return links.latency_scale * (NCCL_BASE_LATENCY_US + 2 * hops_us) * 1e-6


def all_reduce_time_s(
    message_bytes: Num,
    group_size: Num,
    stride: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    collectives: Num = 1.0,
    links: Links = PRIOR,
) -> Num:
    """`collectives` all-reduces moving `message_bytes` in all: bandwidth term 2(n−1)/n·bytes/busbw, plus
    the lower of NCCL's ring and tree latencies each (NCCL picks the faster algorithm per call)."""
    n = np.asarray(group_size, dtype=float)

    def link(size: Num, spacing: Num) -> tuple[Num, Num]:
        latency = np.minimum(
            ring_latency_s(np.asarray(size, dtype=float), spacing, gpus_per_node, gpu, 2, links),
            tree_latency_s(np.asarray(size, dtype=float), spacing, gpus_per_node, gpu, links),
        )
        return group_bus_bandwidth_bytes_per_s(size, spacing, gpus_per_node, gpu, links), latency

    bw, latency = on_distinct_ints(link, group_size, stride)  # a few dozen group shapes
    return np.where(n > 1, 2 * (n - 1) / n * message_bytes / bw + collectives * latency, 0.0)


def reduce_scatter_time_s(
    message_bytes: Num,
    group_size: Num,
    stride: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    collectives: Num = 1.0,
    links: Links = PRIOR,
) -> Num:
    """`collectives` reduce-scatters (or all-gathers: the same traffic reversed) of `message_bytes` in
    all: (n−1)/n·bytes/busbw, plus NCCL's ring latency each (these run only as rings): ZeRO-3's
    per-module gathers pay it hundreds of times per step."""
    n = np.asarray(group_size, dtype=float)

    def link(size: Num, spacing: Num) -> tuple[Num, Num]:
        ring = ring_latency_s(np.asarray(size, dtype=float), spacing, gpus_per_node, gpu, 1, links)
        return group_bus_bandwidth_bytes_per_s(size, spacing, gpus_per_node, gpu, links), ring

    bw, ring = on_distinct_ints(link, group_size, stride)
    latency = collectives * ring
    return np.where(n > 1, (n - 1) / n * message_bytes / bw + latency, 0.0)


all_gather_time_s = reduce_scatter_time_s


def p2p_time_s(message_bytes: Num, crosses_node: Num, gpu: GPUSpec, links: Links = PRIOR) -> Num:
    """One pipeline send/receive between adjacent stages."""
    bw = np.where(crosses_node, gpu.inter_node_bandwidth_gb_per_s, gpu.intra_node_bandwidth_gb_per_s)
    latency = np.where(crosses_node, gpu.inter_node_latency_us, gpu.intra_node_latency_us) * 1e-6
    efficiency = np.where(crosses_node, links.inter_efficiency, links.intra_efficiency)
    return message_bytes / (bw * 1e9 * efficiency) + links.latency_scale * latency


def overlapped_exposed_s(comm_s: Num, compute_s: Num, contention: float) -> Num:
    """Time a collective issued behind `compute_s` of kernels adds to the step: the part that outlasts the
    compute, plus `contention` × the part that runs alongside it.

    NCCL's collectives are kernels: each channel is a CTA that holds an SM for the whole collective and
    copies through it (NCCL docs, "CTA policy": NCCL_CTA_POLICY_EFFICIENCY "is suitable for applications
    which require better compute and communication overlap"; PyTorch PR #130583, "low-contention
    collectives": NCCL "reserve[s] SM resources" and uses "SM-based P2P copy"). The overlapped GEMMs run
    on the SMs left and spill a tail wave (an all-gather's 24 CTAs on an H100's 132 SMs, NVIDIA forum
    thread 337991), so overlap hides a collective only partly: contention ≈ NCCL's CTAs / SMs
    (24 / 132 ≈ 0.18) and up to ~1 when the tail wave doubles a GEMM. Host↔device copies run on the copy
    engines, not on SMs, and do not pay it.
    """
    hidden = np.minimum(comm_s, compute_s)
    return np.maximum(0.0, comm_s - compute_s) + contention * hidden


def host_transfer_time_s(transfer_bytes: Num, gpu: GPUSpec) -> Num:
    """Copy over PCIe between host and GPU (ZeRO-Offload / ZeRO-Infinity)."""
    return transfer_bytes / (gpu.host_to_device_gb_per_s * 1e9)
