"""Collective communication times from group size, message size and where the group sits.

Ring/tree algorithms as NCCL runs them (Thakur et al. 2005; NCCL docs, "Performance"): an all-reduce
moves 2(n−1)/n of the message through each GPU's link, a reduce-scatter or all-gather (n−1)/n.

Placement: ranks are laid out tp fastest, then dp, then pp (Megatron-LM and DeepSpeed's
PipeDataParallelTopology), so a TP group sits inside a node, a DP group spans nodes once tp·dp exceeds
the node, and each pipeline hop crosses nodes once tp·dp fills a node.
"""

from __future__ import annotations

import numpy as np

from service.costmodel.types import Num
from service.spec.hardware import GPUSpec

# Fraction of link bandwidth NCCL collectives sustain on large messages (nccl-tests bus bandwidth vs
# link rate on DGX A100/H100: ~80 %).
NCCL_BUS_EFFICIENCY = 0.8


def group_bus_bandwidth_bytes_per_s(group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec) -> Num:
    """Bus bandwidth per GPU of a group of `group_size` ranks spaced `stride` apart.

    Inside one node it is NVLink. Across nodes, NCCL runs one ring per NIC, so the k members a node
    holds share k NICs: min(NVLink, k × NIC) (one NIC per GPU on DGX-class nodes).
    """
    span = group_size * stride
    members_per_node = np.clip(gpus_per_node // np.maximum(stride, 1), 1, None)
    members_per_node = np.minimum(members_per_node, group_size)
    intra = gpu.intra_node_bandwidth_gb_per_s
    inter = np.minimum(intra, members_per_node * gpu.inter_node_bandwidth_gb_per_s)
    return np.where(span <= gpus_per_node, intra, inter) * 1e9 * NCCL_BUS_EFFICIENCY


def _step_latency_s(group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec) -> Num:
    """Latency of one algorithm step: inter-node when the group leaves the node."""
    spans_nodes = group_size * stride > gpus_per_node
    return np.where(spans_nodes, gpu.inter_node_latency_us, gpu.intra_node_latency_us) * 1e-6


def all_reduce_time_s(
    message_bytes: Num, group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec, collectives: Num = 1.0
) -> Num:
    """`collectives` all-reduces moving `message_bytes` in all: bandwidth term 2(n−1)/n·bytes/busbw, plus
    2·log2(n) latency steps each (NCCL's double binary tree; Sanders et al. 2009)."""
    n = np.asarray(group_size, dtype=float)
    bw = group_bus_bandwidth_bytes_per_s(group_size, stride, gpus_per_node, gpu)
    latency = collectives * 2 * np.log2(np.maximum(n, 2)) * _step_latency_s(n, stride, gpus_per_node, gpu)
    return np.where(n > 1, 2 * (n - 1) / n * message_bytes / bw + latency, 0.0)


def reduce_scatter_time_s(
    message_bytes: Num, group_size: Num, stride: Num, gpus_per_node: int, gpu: GPUSpec, collectives: Num = 1.0
) -> Num:
    """`collectives` reduce-scatters (or all-gathers: the same traffic reversed) of `message_bytes` in
    all: (n−1)/n·bytes/busbw, plus n−1 latency steps each, since NCCL runs these as rings: ZeRO-3's
    per-module gathers pay it hundreds of times per step on groups of hundreds of ranks."""
    n = np.asarray(group_size, dtype=float)
    bw = group_bus_bandwidth_bytes_per_s(group_size, stride, gpus_per_node, gpu)
    latency = collectives * (n - 1) * _step_latency_s(n, stride, gpus_per_node, gpu)
    return np.where(n > 1, (n - 1) / n * message_bytes / bw + latency, 0.0)


all_gather_time_s = reduce_scatter_time_s


def p2p_time_s(message_bytes: Num, crosses_node: Num, gpu: GPUSpec) -> Num:
    """One pipeline send/receive between adjacent stages."""
    bw = np.where(crosses_node, gpu.inter_node_bandwidth_gb_per_s, gpu.intra_node_bandwidth_gb_per_s)
    latency = np.where(crosses_node, gpu.inter_node_latency_us, gpu.intra_node_latency_us) * 1e-6
    return message_bytes / (bw * 1e9 * NCCL_BUS_EFFICIENCY) + latency


def host_transfer_time_s(transfer_bytes: Num, gpu: GPUSpec) -> Num:
    """Copy over PCIe between host and GPU (ZeRO-Offload / ZeRO-Infinity)."""
    return transfer_bytes / (gpu.host_to_device_gb_per_s * 1e9)
