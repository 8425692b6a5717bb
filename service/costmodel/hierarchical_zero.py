"""ZeRO-3's collectives and shards with DeepSpeed's ZeRO++ (hpZ, qwZ, qgZ) and with shard groups (HSDP).

Plain ZeRO-3 (Rajbhandari et al. 2020, §7.2.2) all-gathers each module's parameters over all dp·cp
ranks in forward and again in backward, and reduce-scatters the gradients: 3 × Ψ-sized messages per
micro-batch across nodes. ZeRO++ (Wang et al. 2023, arXiv 2306.10209, §3; "4x less communication")
cuts the cross-node volume from 3M to 0.75M:

* qwZ (§3.1): the forward all-gather moves int8 weights with per-block scales instead of 16-bit:
  half the bytes (block-based quantization; the scales are < 1 % at block size 2,048).
* hpZ (§3.2): a secondary copy of the parameters, sharded only over the `zero_hpz_partition_size`
  ranks of a node, serves the backward all-gather over NVLink; it costs Ψ/hpz more parameter bytes.
* qgZ (§3.3): gradients are reduced with int4 all-to-alls (hierarchically, intra- then inter-node)
  instead of a 16-bit reduce-scatter: a quarter of the bytes.

Shard groups (`Plan.shard_group_size`; FSDP's hybrid shard, HSDP: ShardingStrategy.HYBRID_SHARD, FSDP2
on a (replicate, shard) mesh; MiCS, Zhang et al. 2022, arXiv 2205.00119, is the same layout) shard the
model states over groups of `shard_group_size` ranks only and replicate them across groups: parameter
gathers and gradient reduce-scatters stay inside a group, and the replicas all-reduce their gradient
shard, once per micro-batch for FSDP (after every backward unless `set_requires_all_reduce(False)`) or
once per step (MiCS's 2-hop synchronisation at the accumulation boundary): the engine's `replica_sync`.
DeepSpeed config keys of ZeRO++: service/spec/zero.py `hierarchical_zero_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel import comm
from service.costmodel.types import Num
from service.spec.hardware import GPUSpec
from service.spec.plan_table import PlanTable

QWZ_BYTES_RATIO = 0.5  # int8 over 16-bit weights (ZeRO++ §3.1)
QGZ_BYTES_RATIO = 0.25  # int4 over 16-bit gradients (ZeRO++ §3.3)


def shard_ranks(p: PlanTable) -> np.ndarray:
    """Ranks the model states are sharded over: the dp·cp ZeRO ranks, or the plan's shard group."""
    return np.where(p.shard_group_size > 0, p.shard_group_size, p.dp * p.cp)


def hpz_secondary_bytes(sharded_params: Num, param_bytes: Num, hpz: Num) -> Num:
    """hpZ's secondary parameter partition: the 16-bit parameters sharded over the hpZ group."""
    return np.where(hpz > 1, param_bytes * sharded_params / np.maximum(hpz, 1), 0.0)


@dataclass(frozen=True)
class Zero3Comm:
    """ZeRO-3 collective time: what each micro-batch moves (hidden behind its compute where it can
    be) and what each optimizer step adds once (a once-per-step replica all-reduce, not overlapped)."""

    per_micro_batch: np.ndarray
    per_step: np.ndarray
    gathers: np.ndarray  # the forward and backward parameter gathers alone (part of per_micro_batch)
    backward_gather: np.ndarray  # one backward pass's gather alone (hpZ's secondary shard where it has one)
    reduces: np.ndarray  # the gradient reduce-scatters alone (part of per_micro_batch)


def zero3_collectives_s(
    p: PlanTable,
    params_bytes: Num,
    grads_bytes: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    collectives: Num,
    links: comm.Links,
    reduce_collectives: Num | None = None,
) -> Zero3Comm:
    """Forward gather + backward gather + gradient reduce-scatter per micro-batch, and the replicas'
    all-reduce of their gradient shard (per micro-batch or per step, the engine's `replica_sync`), for
    plain ZeRO-3, ZeRO++ and shard groups (see the module docstring). `collectives` gathers per pass;
    the reduce-scatters are as many unless `reduce_collectives` says otherwise."""
    reduce_calls = collectives if reduce_collectives is None else reduce_collectives
    group, stride = shard_ranks(p), p.tp
    weights = np.where(p.zero_quantized_weights, QWZ_BYTES_RATIO, 1.0) * params_bytes
    forward = comm.all_gather_time_s(weights, group, stride, gpus_per_node, gpu, collectives, links)
    hpz = p.zero_hpz_partition_size
    secondary = comm.all_gather_time_s(params_bytes, hpz, stride, gpus_per_node, gpu, collectives, links)
    backward = np.where(hpz > 1, secondary, forward)
    grads = np.where(p.zero_quantized_gradients, QGZ_BYTES_RATIO, 1.0) * grads_bytes
    reduce = comm.reduce_scatter_time_s(grads, group, stride, gpus_per_node, gpu, reduce_calls, links)
    replicas = p.dp * p.cp // np.maximum(group, 1)
    shard = grads_bytes / np.maximum(group, 1)
    grouped = p.shard_group_size > 0
    every_micro_batch = grouped & p.engine_is("replica_sync", "micro_batch")
    # Per micro-batch (FSDP), each block's shard is all-reduced after its reduce-scatter: one call each.
    calls = np.where(every_micro_batch, collectives, 1.0)
    across = comm.all_reduce_time_s(shard, replicas, stride * group, gpus_per_node, gpu, calls, links)
    per_micro_batch = forward + backward + reduce + np.where(every_micro_batch, across, 0.0)
    per_step = np.where(grouped & ~every_micro_batch, across, 0.0)
    return Zero3Comm(
        np.asarray(per_micro_batch, dtype=float),
        np.asarray(per_step, dtype=float),
        np.asarray(forward + backward, dtype=float),
        np.asarray(backward, dtype=float),
        np.asarray(reduce, dtype=float),
    )
