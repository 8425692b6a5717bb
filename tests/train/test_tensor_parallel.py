"""Megatron-style TP layers on 2 gloo processes: outputs and gradients equal the unsharded layers'."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from service.cluster.ports import free_port
from service.train import tensor_parallel as tpl
from tests.train import local_workers

pytestmark = pytest.mark.slow  # two real processes on gloo (a few seconds)

B, S, H, F = 2, 8, 12, 20  # batch, sequence (divisible by tp), hidden, MLP width (both even)
ATOL = 1e-5


def _reference(seed: int) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.nn.Linear(H, F), torch.nn.Linear(F, H), torch.randn(B, S, H)


def _mlp_case(rank: int, world: int, sequence_parallel: bool) -> None:
    """column → gelu → row, with the input whole (or split along the sequence with SP)."""
    up, down, x = _reference(0)
    x_ref = x.clone().requires_grad_(True)
    y_ref = down(torch.nn.functional.gelu(up(x_ref)))
    y_ref.pow(2).sum().backward()

    col = tpl.ColumnParallelLinear.from_linear(up, None, sequence_parallel=sequence_parallel)
    row = tpl.RowParallelLinear.from_linear(down, None, sequence_parallel=sequence_parallel)
    x_in = x.clone().requires_grad_(True)
    h = tpl.scatter_to_sequence_region(x_in, None) if sequence_parallel else x_in
    y = row(torch.nn.functional.gelu(col(h)))
    if sequence_parallel:
        assert y.shape == (B, S // world, H)  # the block's output stays split along the sequence
        y = tpl.gather_from_sequence_region(y, None)
    # the loss is replicated on every rank, as a model's loss is: count it once
    (y.pow(2).sum() / (world if sequence_parallel else 1)).backward()
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    rows = slice(rank * F // world, (rank + 1) * F // world)
    torch.testing.assert_close(col.weight.grad, up.weight.grad[rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(col.bias.grad, up.bias.grad[rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(row.weight.grad, down.weight.grad[:, rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(row.bias.grad, down.bias.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(x_in.grad, x_ref.grad, atol=ATOL, rtol=0)
    assert col.weight.tensor_model_parallel and row.weight.tensor_model_parallel


def _head_case(rank: int, world: int) -> None:
    """A gathered column-parallel head (the proxy's lm_head): whole logits on every rank."""
    up, _, x = _reference(1)
    x_ref = x.clone().requires_grad_(True)
    up(x_ref).logsumexp(-1).sum().backward()
    head = tpl.ColumnParallelLinear.from_linear(up, None, gather_output=True)
    x_in = x.clone().requires_grad_(True)
    logits = head(x_in)
    assert logits.shape == (B, S, F)
    logits.logsumexp(-1).sum().backward()
    rows = slice(rank * F // world, (rank + 1) * F // world)
    torch.testing.assert_close(head.weight.grad, up.weight.grad[rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(x_in.grad, x_ref.grad, atol=ATOL, rtol=0)


def _norm_grad_case(rank: int, world: int) -> None:
    """With SP a norm sees its rank's tokens; the hook sums its weight gradient over the group."""
    torch.manual_seed(2)
    norm, x = torch.nn.LayerNorm(H), torch.randn(B, S, H)
    norm(x).pow(2).sum().backward()
    full = norm.weight.grad.clone()
    norm.weight.grad = None
    tpl.allreduce_sequence_parallel_grads(norm, None)
    norm(tpl.scatter_to_sequence_region(x, None)).pow(2).sum().backward()
    torch.testing.assert_close(norm.weight.grad, full, atol=ATOL, rtol=0)


CASES = {
    "mlp": lambda rank, world: _mlp_case(rank, world, sequence_parallel=False),
    "mlp-sp": lambda rank, world: _mlp_case(rank, world, sequence_parallel=True),
    "head": _head_case,
    "norm-sp": _norm_grad_case,
}


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, case in CASES.items():
            try:
                case(rank, world)
            except AssertionError as err:
                raise AssertionError(f"case {name}: {err}") from err
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_layers_match_the_unsharded_layers():
    """Every case in one pair of processes (process start-up dominates): MLP without and with SP, a
    gathered head, a sequence-parallel norm's gradient."""
    local_workers.start(_worker, (2, free_port()), nprocs=2)


def test_a_width_tp_does_not_divide_is_refused(monkeypatch):
    monkeypatch.setattr(tpl, "_world", lambda group: 3)
    with pytest.raises(ValueError, match="not divisible by tp 3"):
        tpl.ColumnParallelLinear.from_linear(torch.nn.Linear(4, 5), None)
