"""Pipeline-parallel communication of one micro-batch: the stage-boundary sends as each engine makes
them, and Megatron-Core's overlap of them with the interleaved schedule's compute."""

from __future__ import annotations

import numpy as np

from service.costmodel import comm
from service.costmodel.types import Num
from service.spec.hardware import ClusterSpec, GPUSpec
from service.spec.plan_table import PlanTable


def pp_comm_per_micro_batch_s(
    cluster: ClusterSpec,
    p: PlanTable,
    hidden_bytes: Num,
    gpu: GPUSpec,
    net: comm.Links,
    micro_batch_compute_s: Num,
    contention: float,
) -> np.ndarray:
    """Exposed stage-boundary traffic of one micro-batch: activations forward and their gradients
    backward, once per model chunk (the interleaved schedule with v chunks per stage sends v times as
    many messages, Narayanan et al. 2021 §2.2.2). A hop crosses nodes once tp·dp·cp fills a node
    (comm.py's placement). With --overlap-p2p-communication (interleaved schedule only) each chunk's
    sends and receives run while the next chunk computes (megatron/core/pipeline_parallel/schedules.py,
    `forward_backward_pipelining_with_interleaving`, `overlap_p2p_comm`).

    Megatron and torch.distributed.pipelining post an exchange's send and receive together, so a stage
    pays one transfer per neighbour and micro-batch. DeepSpeed's PipelineEngine makes each a blocking
    call of its own (`pipeline_blocking_p2p`): a middle stage receives the activation and sends the
    gradient back to the stage before, then sends its activation and receives the gradient from the
    stage after, four transfers one after the other; with two stages each has one neighbour, two."""
    v = p.virtual_stages
    crosses = p.dp * p.tp * p.cp >= cluster.gpus_per_node
    transfers = np.where(p.engine_column("pipeline_blocking_p2p") & (p.pp > 2), 4, 2)
    send = _pipeline_send_s(cluster, p, hidden_bytes, crosses, gpu, net)
    sends = np.where(p.pp > 1, transfers * v * send, 0.0)
    hidden = p.comm_overlap & (v > 1)
    return np.asarray(
        np.where(hidden, comm.overlapped_exposed_s(sends, micro_batch_compute_s, contention), sends),
        dtype=float,
    )


def _pipeline_send_s(
    cluster: ClusterSpec,
    p: PlanTable,
    hidden_bytes: Num,
    crosses: Num,
    gpu: GPUSpec,
    net: comm.Links,
) -> np.ndarray:
    """One stage-boundary send of a micro-batch's hidden state, as each tensor-parallel rank pays it.

    With sequence parallelism the hidden state between stages is the rank's sequence chunk, 1/tp of it
    (Korthikanti et al. 2022, §4.2.2; the proxy's PipelineModule sends that chunk). Megatron-LM without
    it splits the tensor into tp chunks, each rank sends one across the node boundary and the receiving
    stage all-gathers them over NVLink (Narayanan et al. 2021, §4.1 "scatter/gather communication
    optimization"; megatron/core/pipeline_parallel/p2p_communication.py,
    `scatter_gather_tensors_in_pipeline`). DeepSpeed's PipelineEngine sends the whole tensor from every
    tensor-parallel rank (runtime/pipe/engine.py `_exec_send_activations`).
    """
    megatron = p.engine_column("pipeline_scatter_gather")  # Megatron-LM's scatter/gather
    send = comm.p2p_time_s(
        hidden_bytes / np.where(p.sequence_parallel | megatron, p.tp, 1), crosses, gpu, net
    )
    gather = comm.all_gather_time_s(hidden_bytes, p.tp, 1, cluster.gpus_per_node, gpu, 1.0, net)  # 0 at tp 1
    return np.asarray(send + np.where(megatron & ~p.sequence_parallel, gather, 0.0), dtype=float)
