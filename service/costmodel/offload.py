"""Host offload time: ZeRO-Offload's optimizer on the CPU (Ren et al. 2021) and ZeRO-Infinity's parameter
offload to CPU memory (Rajbhandari et al. 2021), priced as DeepSpeed 0.19.8 runs them (deepspeed/runtime/
zero/). One function per term; `offload_time_s` assembles them.

What DeepSpeed copies, and when:

* Parameters (`offload_param`, ZeRO-3 only; it does not require `offload_optimizer`, stage3.py
  `_configure_offloading` sets the two apart). The partition of each parameter lives in one pinned CPU
  buffer per group (stage3.py `_create_param_groups_fp16_flat_cpu_memory` pins it whatever
  `pin_memory` says). Every gather, forward, backward and a recomputed forward alike, first copies the
  rank's shard to the GPU (partition_parameters.py `_all_gather_dtype` / `_all_gather_sequential`:
  `p.ds_tensor.to(device)`, a blocking copy: PyTorch's `copy_kernel_cuda` runs `memcpy_and_sync`) on
  the coordinator's all-gather stream (partitioned_param_coordinator.py `__all_gather_params_`: `with
  stream(self.__allgather_stream)`), then starts the NCCL all-gather. So the copy overlaps compute as
  prefetching does, but runs in series with the gathers of that stream. Tensors under the persistence
  threshold stay gathered on the GPU (`ds_persist`), re-gathered once after each step (`_post_step`).
* hpZ with parameter offload: the secondary partition is allocated on the offload device too
  (`_partition_param_sec`: `device=self.remote_device`); it is dropped after every step (stage3.py
  `_post_step` → `invalidate_secondary_tensor`), written back from the GPU when the first forward
  releases each parameter (a blocking copy on the compute stream, then `current_stream().synchronize()`),
  and every later gather of the step reads it (`use_secondary_tensor` whenever it exists).
* Gradients (`offload_optimizer`): after each bucket's reduction, on the reduction stream, so in series
  with the reductions and overlapped with backward. Stage 3 copies the reduced partition to the host
  buffer and back every micro-batch (stage3.py `partition_grads`: `grad_buffer.copy_(...,
  non_blocking=True)` then `grad_buffer.to(device)`; later micro-batches fetch, add, copy back), and at
  the accumulation boundary the fp32 gradient once more (`_offload_grad_partition_at_boundary`). Stage 2
  reduces every micro-batch and, with gradient accumulation, keeps the running sum on the host (stage_1_
  and_2.py `copy_grads_in_partition` → `async_accumulate_grad_in_cpu_via_gpu`: the first micro-batch
  copies down, later ones up, add, down), then at the boundary copies the fp32 gradient down
  (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`). Stage 1 reduces only at the boundary and does
  the same there once.
* The step: DeepSpeedCPUAdam (ops/adam/cpu_adam.py `step` → the C++ `adam_update`) blocks the host;
  nothing is queued behind it, so it overlaps nothing. Then the updated 16-bit parameters: stage 1-2
  copy them up (`bit16_partitions[...].copy_(bit16_partition_buffer, non_blocking=True)`) just before
  the parameter all-gather needs them; stage 3 copies the fp32 partition into the 16-bit partition
  (`_reassign_or_swap_out_partitioned_parameters`, a blocking copy): up when only the optimizer is
  offloaded, a host-side copy when both are (the next step's gathers bring them up), and down, from
  the fp32 master on the GPU, when only the parameters are.

The PCIe link: on a DGX-style node each GPU's PCIe Gen5 x16 link also carries its NIC's GPUDirect RDMA
traffic, in the same directions as the host copies (a gather's received bytes enter the GPU as the
fetched shards do). Stream order already puts each copy in series with its own stream's collectives,
and the link puts it in series with the other stream's inter-node traffic, so a copy hides only in the
compute time the data-parallel collectives leave free (`copy_exposed_s`). It pays no SM contention for
the part it hides: copies run on the copy engines (comm.overlapped_exposed_s).

Assumptions: `gpu.host_to_device_gb_per_s` in both directions for every copy, i.e. pinned host memory;
DeepSpeed's default is `pin_memory: true` (runtime/zero/offload_config.py), and pageable buffers (the
hpZ secondary and the gradient buffers with `pin_memory: false`, the temporaries of a blocking copy that
changes dtype) copy slower and block the host. Without overlap (`Workload.overlap_comm` off) DeepSpeed
gathers, reduces and copies on the compute stream: nothing hides. Host-side copies (the fp32 → 16-bit
conversion after CPU Adam) and the CPU side of the accumulation are not priced. A parameter that
straddles a partition edge is counted once (DeepSpeed's stage 1-2 accumulator holds it whole). FSDP's
CPUOffload (parameters and optimizer together) is priced with DeepSpeed's ZeRO-3 schedule, unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel import comm
from service.costmodel import hierarchical_zero as hz
from service.costmodel import memory as mem
from service.costmodel.types import Num
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable

# DeepSpeed's master weights and their gradients are fp32 unless configured otherwise (stage3.py and
# stage_1_and_2.py `master_weights_and_grads_dtype`).
MASTER_BYTES = 4


def param_fetch_bytes_per_step(
    offloaded_params: Num,
    param_bytes: Num,
    shards: Num,
    hpz: Num,
    gathers_per_micro_batch: Num,
    grad_accum: Num,
) -> np.ndarray:
    """Host → GPU bytes of the offloaded parameter shards in one step: each of the step's
    `gathers_per_micro_batch` × `grad_accum` gathers copies the rank's shard up first (partition_parameters.py
    `_all_gather_dtype`: `p.ds_tensor.to(device)`). With hpZ (`hpz` > 1) only the first micro-batch's
    forward reads the primary shard (Ψ/shards); every later gather reads the secondary, Ψ/hpz
    (`use_secondary_tensor`, rebuilt each step: stage3.py `invalidate_secondary_tensor`)."""
    gathers = np.asarray(gathers_per_micro_batch, dtype=float) * grad_accum
    primary = np.asarray(offloaded_params, dtype=float) * param_bytes / shards
    secondary = np.asarray(offloaded_params, dtype=float) * param_bytes / np.maximum(hpz, 1)
    return np.asarray(np.where(hpz > 1, primary + (gathers - 1) * secondary, gathers * primary), dtype=float)


def hpz_secondary_write_bytes_per_step(offloaded_params: Num, param_bytes: Num, hpz: Num) -> np.ndarray:
    """GPU → host bytes of hpZ's secondary partition, rebuilt on the host once a step as the first forward
    releases each parameter (partition_parameters.py `_partition_param_sec`, on `remote_device`); a
    blocking copy on the compute stream, followed by a stream synchronize: nothing hides it."""
    secondary = np.asarray(offloaded_params, dtype=float) * param_bytes / np.maximum(hpz, 1)
    return np.asarray(np.where(hpz > 1, secondary, 0.0), dtype=float)


def grad_copy_bytes_per_step(
    shard_params: Num, grad_bytes: Num, zero_stage: Num, grad_accum: Num
) -> tuple[np.ndarray, np.ndarray]:
    """(GPU → host, host → GPU) gradient bytes of one step with the optimizer offloaded.

    Stage 3 (stage3.py `partition_grads`): every micro-batch copies the reduced partition down and back
    up (the first into the host buffer then `.to(device)`; later ones fetch, add, copy down), in the
    accumulation dtype (`grad_bytes`); the boundary copies the fp32 gradient down once more
    (`_offload_grad_partition_at_boundary`). Stage 2 (stage_1_and_2.py `copy_grads_in_partition`): with
    accumulation, micro-batch 0 copies down and each later one up and down
    (`async_accumulate_grad_in_cpu_via_gpu`); then the fp32 gradient down
    (`async_inplace_copy_grad_to_fp32_buffer_from_gpu`). Stage 1 reduces at the boundary only, where
    micro_step_id = ga − 1 > 0 takes the same accumulate path once."""
    shard = np.asarray(shard_params, dtype=float)
    ga = np.asarray(grad_accum, dtype=float)
    accumulating = ga > 1
    down = np.select([zero_stage == 3, zero_stage == 2], [ga, np.where(accumulating, ga, 0.0)], accumulating)
    up = np.select([zero_stage == 3, zero_stage == 2], [ga, ga - 1], accumulating)
    d2h = shard * (down * grad_bytes + MASTER_BYTES)
    return np.asarray(d2h, dtype=float), np.asarray(shard * up * grad_bytes, dtype=float)


def updated_param_copy_bytes_per_step(
    shard_params: Num, param_bytes: Num, offload_optimizer: Num, offload_params: Num
) -> np.ndarray:
    """Bytes the updated parameters cross PCIe after the step. Optimizer offloaded, parameters on the GPU:
    the 16-bit shard goes up (stage_1_and_2.py `step`; stage3.py `_reassign_or_swap_out_partitioned_
    parameters`; a blocking copy that changes dtype converts on the CPU, so 16-bit bytes cross). Both
    offloaded: a host-side copy, nothing crosses (the next step's gathers fetch them). Parameters alone:
    the fp32 master on the GPU goes down into the host's 16-bit partition, converted on the CPU, so the
    fp32 bytes cross (PyTorch `copy_kernel_cuda`: blocking copies convert on the CPU)."""
    shard = np.asarray(shard_params, dtype=float)
    optimizer, params = np.asarray(offload_optimizer, dtype=bool), np.asarray(offload_params, dtype=bool)
    up = np.where(optimizer & ~params, shard * param_bytes, 0.0)
    down = np.where(params & ~optimizer, shard * MASTER_BYTES, 0.0)
    return np.asarray(up + down, dtype=float)


def cpu_adam_time_s(shard_params: Num, gpu: GPUSpec) -> np.ndarray:
    """DeepSpeedCPUAdam's step over the rank's shard (ops/adam/cpu_adam.py `step` → `adam_update`): it
    blocks the host and nothing is queued on the GPU meanwhile, so all of it is exposed."""
    return np.asarray(np.asarray(shard_params, dtype=float) / (gpu.cpu_adam_gparams_per_s * 1e9), dtype=float)


def copy_exposed_s(copy_s: Num, collective_s: Num, compute_s: Num) -> np.ndarray:
    """Time host copies issued behind `compute_s` add to the step when the data-parallel collectives of
    the same window take `collective_s`: copy and collectives run in series (stream order, and the PCIe
    link each GPU shares with its NIC), so the copy hides only in the compute they leave free. No SM
    contention on the hidden part: copy engines, not SMs, move it."""
    busy = np.asarray(collective_s, dtype=float)
    over = np.maximum(0.0, busy + copy_s - compute_s) - np.maximum(0.0, busy - compute_s)
    return np.asarray(over, dtype=float)


@dataclass(frozen=True)
class OffloadSlice:
    """Parameters one optimizer's states cover, as offload moves them: `psi` per GPU before sharding,
    sharded over `shards` ranks; `on_host` of them live on the host under parameter offload (ZeRO-3's
    partitions, less the tensors it keeps whole on the GPU); `hpz` ranks share hpZ's secondary partition
    (1 = none). A dense model is one slice; a MoE model's routed experts are a second, sharded over
    their own expert-data-parallel group (costmodel/expert_sync.py)."""

    psi: np.ndarray
    shards: np.ndarray
    on_host: np.ndarray
    hpz: np.ndarray


def dense_slice(model: ModelSpec, p: PlanTable, psi: Num) -> OffloadSlice:
    """The dense view's slice: sharded over the plan's dp·cp ranks (or its shard group), ZeRO-3 keeping
    its persistent tensors on the GPU."""
    psi = np.asarray(psi, dtype=float)
    persistent = mem.zero3_persistent_params(model, p.tp, p.pp, p.virtual_stages)
    shards, hpz = np.asarray(hz.shard_ranks(p)), np.asarray(p.zero_hpz_partition_size)
    return OffloadSlice(psi, shards, psi - persistent, hpz)


def offload_time_s(
    p: PlanTable,
    slices: list[OffloadSlice],
    gathers_per_micro_batch: Num,
    collective_s: Num,
    compute_s: Num,
    gpu: GPUSpec,
) -> np.ndarray:
    """Exposed offload time per step of all `slices`: the parameter fetches and gradient copies behind
    compute (in series with the collectives, and with each other: one PCIe link, `copy_exposed_s`),
    plus CPU Adam over every slice's shard, the updated parameters' copy and hpZ's secondary write-back,
    which nothing hides.

    `gathers_per_micro_batch`: ZeRO-3's parameter gathers per micro-batch in units of the whole shard
    (2, more under full recompute where DeepSpeed gathers again: data_parallel.regathered_fraction).
    `collective_s` and `compute_s`: one hiding window's hideable collectives and compute. The window is a
    micro-batch for stages 2-3 (stage 3: gathers and reductions behind forward and backward; stage 2:
    reductions behind backward) and the step's one reducing backward for stage 1; `compute_s` = 0 where
    collectives are not overlapped."""
    pb, gb, _ = mem.state_bytes_per_param(p.precision, p.zero_stage)  # no offload on fp32-grad engines
    ga = p.grad_accum
    behind = np.zeros(len(p))
    serial = np.zeros(len(p))
    cpu = np.zeros(len(p))
    for piece in slices:
        shard = piece.psi / piece.shards  # offload needs ZeRO ≥ 1: the states are sharded
        fetch = param_fetch_bytes_per_step(
            piece.on_host, pb, piece.shards, piece.hpz, gathers_per_micro_batch, ga
        )
        down, up = grad_copy_bytes_per_step(shard, gb, p.zero_stage, ga)
        behind = behind + np.where(p.offload_params, fetch, 0.0)
        behind = behind + np.where(p.offload_optimizer, down + up, 0.0)
        serial = serial + updated_param_copy_bytes_per_step(shard, pb, p.offload_optimizer, p.offload_params)
        write_back = hpz_secondary_write_bytes_per_step(piece.on_host, pb, piece.hpz)
        serial = serial + np.where(p.offload_params, write_back, 0.0)
        cpu = cpu + np.where(p.offload_optimizer, cpu_adam_time_s(shard, gpu), 0.0)
    windows = np.where(p.zero_stage == 1, 1, ga)
    copies = comm.host_transfer_time_s(behind / windows, gpu)
    hidden = windows * copy_exposed_s(copies, collective_s, compute_s)
    offload = hidden + cpu + comm.host_transfer_time_s(serial, gpu)
    return np.asarray(np.where(p.offload_optimizer | p.offload_params, offload, 0.0), dtype=float)
