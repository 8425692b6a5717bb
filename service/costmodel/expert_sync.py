"""The routed experts' data-parallel sync: their gradients reduced (and ZeRO's gathers) over the
expert-data-parallel group, priced by the dense slice's rules (costmodel/data_parallel.py) and run in
series with the dense slice's in the same windows; their optimizer step, on the GPU or offloaded with the
dense one (offload.py). The rest of a MoE model's terms are in costmodel/moe.py."""

from __future__ import annotations

import numpy as np

from service.costmodel import comm, compute
from service.costmodel import memory as mem
from service.costmodel.data_parallel import ZeroTraffic, block_sharded
from service.costmodel.moe import expert_data_parallel, expert_params_per_gpu
from service.costmodel.offload import OffloadSlice
from service.costmodel.types import Num
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable


def expert_gradient_traffic(
    psi_expert: Num,
    p: PlanTable,
    grad_bytes: Num,
    param_bytes: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
) -> ZeroTraffic:
    """The expert slice's data-parallel collectives over the expert-data-parallel group (ranks
    ep·expert_tp apart), as the dense slice's are described (`data_parallel.ZeroTraffic`), so the two
    overlap with backward by the same rules (`data_parallel.exposed_comm_s`): the gradient all-reduce
    (ZeRO 0), the reduction of ZeRO 1-2 (DeepSpeed's bucket all-reduce, else a reduce-scatter; stage 2
    every micro-batch) and the updated slice's all-gather, ZeRO-3's two gathers and one reduce-scatter
    per micro-batch. Megatron-Core keeps the experts in buffers of their own over the expert-data-
    parallel group, reduced like the dense ones once the last micro-batch's backward has made the
    gradients (distributed_data_parallel.py `expert_parallel_buffers`); DeepSpeed's ZeRO 1-2 reduce the
    expert parameter groups over that group with the rest (stage_1_and_2.py `_configure_moe_settings`)."""
    edp = expert_data_parallel(p)
    stride = p.ep * p.expert_tp
    grads, params = psi_expert * grad_bytes, psi_expert * param_bytes
    ar = comm.all_reduce_time_s(grads, edp, stride, gpus_per_node, gpu, 1.0, links)
    rs = comm.reduce_scatter_time_s(grads, edp, stride, gpus_per_node, gpu, 1.0, links)
    ag = comm.all_gather_time_s(params, edp, stride, gpus_per_node, gpu, 1.0, links)
    zero = np.zeros(len(p))
    return ZeroTraffic(
        psi=np.asarray(psi_expert, dtype=float),
        fsdp=block_sharded(p),
        all_reduce=ar,
        reduce=np.where(p.engine_is("gradient_reduce", "all_reduce"), ar, rs),
        gather=ag,
        per_micro_batch=np.asarray(2 * ag + rs, dtype=float),
        unhidden=zero,
        list_copies=zero,
        per_step=zero,
        regather=zero,
    )


def traffic(
    model: ModelSpec,
    p: PlanTable,
    moe_blocks: Num,
    gpus_per_node: int,
    gpu: GPUSpec,
    links: comm.Links,
    fp32_grads: bool = False,
) -> ZeroTraffic | None:
    """The collectives of the experts of a stage's `moe_blocks` (`expert_gradient_traffic`), which run
    in series with the dense slice's (data_parallel.in_series); None for a dense model. `fp32_grads`:
    Workload.grad_reduce_in_fp32."""
    if model.moe is None:
        return None
    psi = expert_params_per_gpu(model, moe_blocks, p)
    pb, gb, _ = mem.plan_state_bytes(p, fp32_grads)
    return expert_gradient_traffic(psi, p, gb, pb, gpus_per_node, gpu, links)


def offload_slice(model: ModelSpec, p: PlanTable, moe_blocks: Num) -> OffloadSlice:
    """The routed experts as offload moves them (offload.py): sharded over the expert-data-parallel
    group, no tensor kept whole on the GPU, no hpZ partition."""
    psi = expert_params_per_gpu(model, moe_blocks, p)
    return OffloadSlice(psi, np.asarray(expert_data_parallel(p), dtype=float), psi, np.ones(len(p)))


def optimizer_step_s(model: ModelSpec, p: PlanTable, moe_blocks: Num, gpu: GPUSpec) -> np.ndarray:
    """The experts' GPU optimizer step over this rank's shard (ZeRO ≥ 1 shards it over the expert-data-
    parallel group); none when the optimizer is offloaded (its CPU Adam is offload.py's); zeros for a
    dense model."""
    if model.moe is None:
        return np.zeros(len(p))
    psi = expert_params_per_gpu(model, moe_blocks, p)
    shard = psi / np.where(p.zero_stage >= 1, expert_data_parallel(p), 1)
    step = np.where(p.offload_optimizer, 0.0, compute.optimizer_step_time_s(shard, gpu))
    return np.asarray(step, dtype=float)
