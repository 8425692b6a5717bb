"""Tensor-parallel communication of one micro-batch, as each engine runs it.

Megatron-style layers (Shoeybi et al. 2019, §3) all-reduce the block's activations twice in forward and
twice in backward, twice more when full recompute re-runs the forward; with sequence parallelism the
same volume moves as all-gathers and reduce-scatters (Korthikanti et al. 2022, §4.2.2). DeepSpeed's
AutoTP and the proxy's TP layers put every one on the critical path; Megatron-LM hides its backward
input-gradient collectives behind the weight-gradient GEMMs, and Megatron-Core with --tp-comm-overlap
hides every one behind the GEMMs.
"""

from __future__ import annotations

import numpy as np

from service.costmodel import comm
from service.costmodel.types import Num
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable


def tp_comm_per_micro_batch_s(
    model: ModelSpec, p: PlanTable, all_reduce_s: Num, layer_gemm_s: Num, contention: float
) -> np.ndarray:
    """Exposed TP communication of one block and one micro-batch (multiply by the stage's blocks).

    `all_reduce_s`: one all-reduce of the block's activations over the TP group; `layer_gemm_s`: the
    block's forward GEMM time on one rank.
    """
    messages = 4 + 2 * (p.recompute == 2)
    async_backward = p.engine_column("tp_backward_overlap") & (p.tp > 1)
    plain = messages * all_reduce_s
    hidden_backward = (messages - 2) * all_reduce_s + _megatron_tp_backward_s(
        model, p, all_reduce_s, layer_gemm_s, contention
    )
    # Megatron-Core's --tp-comm-overlap (Transformer Engine userbuffers) splits each TP collective into
    # chunks pipelined with the GEMM that produces or consumes it, forward and backward (TE
    # `module/base.py` `initialize_ub`; Wang et al. 2023, "Overlap communication with dependent
    # computation via decomposition", ASPLOS '23): every TP collective runs behind the block's GEMMs
    # (forward: the forward GEMMs; backward: the input- and weight-gradient GEMMs, twice as long).
    forwards = 1 + (p.recompute == 2)
    overlapped = forwards * comm.overlapped_exposed_s(2 * all_reduce_s, layer_gemm_s, contention)
    overlapped = overlapped + comm.overlapped_exposed_s(2 * all_reduce_s, 2 * layer_gemm_s, contention)
    # tp_comm_overlap is allowed only where the engine's table says so (Megatron-Core, with SP).
    per_block = np.where(p.tp_comm_overlap, overlapped, np.where(async_backward, hidden_backward, plain))
    return np.asarray(per_block, dtype=float)


def _megatron_tp_backward_s(
    model: ModelSpec, p: PlanTable, all_reduce_s: Num, layer_gemm_s: Num, contention: float
) -> np.ndarray:
    """One block's backward tensor-parallel communication as Megatron-LM runs it, per micro-batch.

    The column-parallel layers (QKV and the MLP's first matrix) launch their input-gradient all-reduce
    asynchronously and compute their weight gradient while it runs; with sequence parallelism that
    collective is a reduce-scatter, and the all-gather of the layer's input that the weight gradient
    needs runs behind the input-gradient GEMM (megatron/core/tensor_parallel/layers.py,
    `LinearWithGradAccumulationAndAsyncCommunication.backward`; Korthikanti et al. 2022 §4.2.2). What
    stays on the critical path with SP is the all-gather of the output gradient before the
    row-parallel layers (half of an all-reduce each). The hidden part costs `contention` of its time
    (`comm.overlapped_exposed_s`) and whatever outlasts the GEMMs behind it: the weight-gradient GEMMs
    of the column-parallel layers, a share of the block's GEMM time by their parameters (twice that with
    SP, the input-gradient GEMMs too). The column-parallel attention matrices are `q, k, v` (h·(h + 2kv)
    elements with h / a-wide heads), or MLA's q_b and kv_b (`ModelSpec.attention_projections`).
    """
    h = model.hidden_size
    attention_column = sum(p.elements for p in model.attention_projections if p.split == "column")
    column = attention_column + (model.mlp_matrices - 1) * h * model.ffn_hidden_size
    window = layer_gemm_s * column / (model.attention_params_per_layer + model.mlp_params_per_layer)
    sp = np.asarray(p.sequence_parallel, dtype=bool)
    # Without SP: 2 all-reduces hidden. With SP: 2 reduce-scatters and 2 input all-gathers (one
    # all-reduce's volume each pair) hidden, 2 output-gradient all-gathers exposed.
    hidden = 2 * all_reduce_s
    exposed = np.where(sp, all_reduce_s, 0.0)
    overlapped = comm.overlapped_exposed_s(hidden, np.where(sp, 2 * window, window), contention)
    return np.asarray(exposed + overlapped, dtype=float)
