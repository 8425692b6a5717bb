"""Megatron-style tensor-parallel layers on `torch.distributed`, with optional sequence parallelism.

The proxy's own implementation of the layers Megatron-LM builds its transformer from
(NVIDIA/Megatron-LM, megatron/core/tensor_parallel/layers.py: `ColumnParallelLinear`,
`RowParallelLinear`, `LinearWithGradAccumulationAndAsyncCommunication`; mappings.py: the
`_CopyToModelParallelRegion`, `_ReduceFromModelParallelRegion`, `_GatherFromModelParallelRegion`,
`_GatherFromSequenceParallelRegion`, `_ReduceScatterToSequenceParallelRegion` and
`_ScatterToSequenceParallelRegion` autograd functions), small enough to sit inside DeepSpeed's
`PipelineModule` and to run on gloo.

Tensor parallelism (Shoeybi et al. 2019, §3): a column-parallel linear holds rows [r·n/t, (r+1)·n/t) of
the weight (its output features), a row-parallel linear the matching columns (its input features);
attention and MLP are column → row, so each block needs one all-reduce forward (after the row-parallel
layer) and one backward (before the column-parallel layer, `copy_to_region`).

Sequence parallelism (Korthikanti et al. 2022, §4.2.2): between blocks the hidden state is split along
the sequence over the TP group, so norms, residuals and dropout run on s/t tokens; the all-reduce
becomes an all-gather along the sequence before the column-parallel layer and a reduce-scatter after
the row-parallel one (same volume). As in Megatron's
`LinearWithGradAccumulationAndAsyncCommunication`, the column-parallel layer saves only its sequence
shard for backward and gathers it again there, so the saved activations shrink by t as the paper counts.

Tensors are (batch, sequence, hidden) as in Hugging Face models (Megatron uses sequence-first), so the
sequence dimension is 1. Weights are sliced from an unsharded `torch.nn.Linear` (`from_linear`), so a
model built with one seed is the same model at every tp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

SEQ_DIM = 1  # (batch, sequence, hidden)


def _world(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group=group)


def _rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group=group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_world(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (no communication)."""
    return x.chunk(_world(group), dim=dim)[_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over the group, then this rank's chunk along `dim`."""
    chunks = [c.contiguous() for c in x.chunk(_world(group), dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (mappings.py `_CopyToModelParallelRegion`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward; identity backward (`_ReduceFromModelParallelRegion`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's chunk backward
    (`_GatherFromModelParallelRegion`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, -1, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """This rank's sequence chunk forward; all-gather backward (`_ScatterToSequenceParallelRegion`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter backward (`_GatherFromSequenceParallelRegion`
    with `tensor_parallel_output_grad=True`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward
    (`_ReduceScatterToSequenceParallelRegion`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _SequenceGatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) · Wᵀ + b, saving only the shard x (layers.py
    `LinearWithGradAccumulationAndAsyncCommunication` with `sequence_parallel=True`): backward gathers x
    again for the weight gradient and reduce-scatters the input gradient along the sequence."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return torch.nn.functional.linear(_all_gather(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        full = _all_gather(x, SEQ_DIM, ctx.group)
        grad_input = _reduce_scatter(grad.matmul(weight), SEQ_DIM, ctx.group)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_2d.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


def copy_to_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)  # type: ignore[no-any-return]


def reduce_from_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)  # type: ignore[no-any-return]


def gather_from_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group)  # type: ignore[no-any-return]


def scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ScatterToSequenceRegion.apply(x, group)  # type: ignore[no-any-return]


def gather_from_sequence_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _GatherFromSequenceRegion.apply(x, group)  # type: ignore[no-any-return]


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return _ReduceScatterToSequenceRegion.apply(x, group)  # type: ignore[no-any-return]


def _shard_param(full: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.nn.Parameter:
    """This rank's slice of `full` along `dim`, marked as a tensor-parallel parameter: DeepSpeed's
    gradient-norm code (runtime/utils.py `is_model_parallel_parameter`) then sums its norm over the TP
    group instead of counting it once, as it does for parameters every TP rank holds whole."""
    param = torch.nn.Parameter(_split(full.detach(), dim, group).clone())
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(torch.nn.Module):
    """A linear layer whose output features are split over the TP group (layers.py `ColumnParallelLinear`).

    Input: the whole hidden state (or, with `sequence_parallel`, this rank's sequence chunk, gathered
    here). Output: this rank's features, or all of them with `gather_output` (an all-gather, as a
    language-model head whose loss is computed whole on every rank).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup | None,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        if weight.shape[0] % _world(group):
            raise ValueError(f"output features {weight.shape[0]} not divisible by tp {_world(group)}")
        self.weight = _shard_param(weight, 0, group)
        self.bias = _shard_param(bias, 0, group) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: ProcessGroup | None, **kwargs: bool) -> Any:
        """This rank's rows of an unsharded `linear` (same init as the tp=1 model)."""
        return cls(linear.weight, linear.bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = _SequenceGatherLinear.apply(x, self.weight, self.bias, self.group)
        else:
            y = torch.nn.functional.linear(copy_to_region(x, self.group), self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y  # type: ignore[no-any-return]


class RowParallelLinear(torch.nn.Module):
    """A linear layer whose input features are split over the TP group (layers.py `RowParallelLinear`),
    taking a column-parallel layer's output. Partial sums are all-reduced, or with `sequence_parallel`
    reduce-scattered along the sequence; the bias is added once, after the reduction (with SP to this
    rank's tokens, so its gradient is summed over the group as Megatron does for `sequence_parallel`
    parameters)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup | None,
        *,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        if weight.shape[1] % _world(group):
            raise ValueError(f"input features {weight.shape[1]} not divisible by tp {_world(group)}")
        self.weight = _shard_param(weight, 1, group)
        self.bias = torch.nn.Parameter(bias.detach().clone()) if bias is not None else None
        if self.bias is not None and sequence_parallel:  # added to this rank's tokens only
            _sum_grad_over_group(self.bias, group)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: ProcessGroup | None, **kwargs: bool) -> Any:
        """This rank's columns of an unsharded `linear`."""
        return cls(linear.weight, linear.bias, group, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(partial, self.group)
        else:
            y = reduce_from_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


def allreduce_sequence_parallel_grads(module: torch.nn.Module, group: ProcessGroup | None) -> None:
    """Makes the gradients of `module`'s parameters sum over the TP group as they are computed.

    With sequence parallelism a norm sees only its rank's tokens, so its weight gradient is a partial
    sum; Megatron all-reduces such gradients over the TP group after backward
    (megatron/core/distributed/finalize_model_grads.py, `_allreduce_layernorm_grads`). A tensor hook
    does the same per micro-batch, before DeepSpeed accumulates or reduces the gradient.
    """
    for param in module.parameters():
        if param.requires_grad:
            _sum_grad_over_group(param, group)


def _sum_grad_over_group(param: torch.nn.Parameter, group: ProcessGroup | None) -> None:
    param.register_hook(lambda grad: _all_reduce(grad, group))


def _parallel_attention_forward(attn: Any) -> Any:
    """Hugging Face's `LlamaAttention.forward` with the token count read from q_proj's output instead of
    from its input (with sequence parallelism the input is a chunk of the sequence and the
    column-parallel projections gather all of it); heads per rank follow from the sharded widths."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

    def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):  # type: ignore[no-untyped-def]
        query = attn.q_proj(hidden_states)
        shape = (*query.shape[:-1], -1, attn.head_dim)
        query = query.view(shape).transpose(1, 2)
        key = attn.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            attn.config._attn_implementation, eager_attention_forward
        )
        out, _ = interface(
            attn, query, key, value, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs
        )
        return attn.o_proj(out.reshape(*shape[:2], -1).contiguous()), None

    return forward


def apply_tensor_parallel(lm: torch.nn.Module, group: Any, sequence_parallel: bool) -> None:
    """Shards a LlamaForCausalLM's linear layers over `group` in place, as Megatron-LM does (Shoeybi et
    al. 2019, §3): q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel, lm_head
    column-parallel with its logits gathered (the loss is computed whole on every rank). The embedding
    and the norms stay whole on every rank. With `sequence_parallel` the norms run on this rank's chunk
    of the sequence and their weight gradients are summed over the group (Korthikanti et al. 2022)."""
    col, row = ColumnParallelLinear.from_linear, RowParallelLinear.from_linear
    sp = {"sequence_parallel": sequence_parallel}
    for layer in lm.model.layers:  # type: ignore[union-attr]
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (
            col(getattr(attn, n), group, **sp) for n in ("q_proj", "k_proj", "v_proj")
        )
        attn.o_proj = row(attn.o_proj, group, **sp)
        attn.forward = _parallel_attention_forward(attn)
        mlp.gate_proj, mlp.up_proj = col(mlp.gate_proj, group, **sp), col(mlp.up_proj, group, **sp)
        mlp.down_proj = row(mlp.down_proj, group, **sp)
        if sequence_parallel:
            allreduce_sequence_parallel_grads(layer.input_layernorm, group)
            allreduce_sequence_parallel_grads(layer.post_attention_layernorm, group)
    lm.lm_head = col(lm.lm_head, group, gather_output=True, **sp)  # type: ignore[arg-type]
    if sequence_parallel:
        allreduce_sequence_parallel_grads(lm.model.norm, group)  # type: ignore[arg-type]
