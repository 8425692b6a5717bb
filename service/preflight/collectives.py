"""The collectives a plan uses, the bus bandwidth the cost model assumed for them, and how a preflight
worker times them through `torch.distributed` (gloo on CPU, nccl on GPU).

Bus bandwidth as nccl-tests defines it (NVIDIA/nccl-tests doc/PERFORMANCE.md): algbw = S / t, S the
full buffer (an all-gather's output, a reduce-scatter's input), and busbw = algbw × 2(n−1)/n for an
all-reduce, × (n−1)/n for all-gather and reduce-scatter, × 1 for a send/receive. busbw is what a
link sustains, comparable across group sizes, and what `service/costmodel/comm.py` prices: the GPU
catalog's intra/inter-node GB/s times the parameter set's `intra_node_bus_efficiency` /
`inter_node_bus_efficiency` (`comm.group_bus_bandwidth_bytes_per_s`).

Which collectives a plan uses (service/costmodel/data_parallel.py, pipeline.py, estimate.py):
- data parallelism (dp·cp > 1): ZeRO-0 all-reduces gradients; DeepSpeed's ZeRO 1-2 all-reduce
  gradient buckets (`average_tensor`) and all-gather the updated parameters; ZeRO-3 (and FSDP/Megatron's
  sharded stages) all-gather parameters and reduce-scatter gradients;
- tensor parallelism: all-reduces of activations inside the TP group;
- pipeline parallelism: send/receive between adjacent stages;
- every plan: the worker's per-step loss average is an all-reduce over all ranks.

Scopes: "intra_node" (the ranks on one node, all nodes at once) and "inter_node" (one rank per node,
the k-th of each node together, as the cost model prices a group spaced a node apart: one NIC per
member), the latter only when the workers sit on several nodes.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any

from service.spec.hardware import ClusterSpec
from service.spec.params import ModelParams
from service.spec.plan import Plan

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SEND_RECV = "all_reduce", "all_gather", "reduce_scatter", "send_recv"
OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, SEND_RECV)
INTRA, INTER = "intra_node", "inter_node"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` over `n` ranks."""
    if n <= 1:
        return 0.0
    if op == ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if op in (ALL_GATHER, REDUCE_SCATTER):
        return (n - 1) / n
    if op == SEND_RECV:
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def bus_bandwidth_bytes_per_s(op: str, n: int, total_bytes: float, seconds: float) -> float:
    """busbw of one call moving a `total_bytes` buffer among `n` ranks in `seconds`."""
    return total_bytes / seconds * bus_factor(op, n) if seconds > 0 else 0.0


def plan_collectives(plan: Plan) -> list[tuple[str, str]]:
    """(collective, why) for each collective `plan` issues, all-reduce first (see the module docstring)."""
    out: dict[str, str] = {ALL_REDUCE: "the per-step loss average over all ranks"}
    if plan.dp * plan.cp > 1:
        sharded = plan.zero_stage == 3 or (plan.engine != "deepspeed" and plan.zero_stage >= 2)
        if sharded:
            out[ALL_GATHER] = f"ZeRO-{plan.zero_stage}: parameter gathers"
            out[REDUCE_SCATTER] = f"ZeRO-{plan.zero_stage}: gradient reduce-scatters"
        else:
            out[ALL_REDUCE] = f"ZeRO-{plan.zero_stage}: gradient all-reduce over dp·cp = {plan.dp * plan.cp}"
            if plan.zero_stage in (1, 2):
                out[ALL_GATHER] = f"ZeRO-{plan.zero_stage}: updated-parameter gather"
    if plan.tp > 1:
        out[ALL_REDUCE] = out[ALL_REDUCE] + f"; tensor-parallel all-reduces over tp = {plan.tp}"
    if plan.pp > 1:
        out[SEND_RECV] = f"pipeline send/receive between {plan.pp} stages"
    return list(out.items())


def assumed_bus_bandwidth_bytes_per_s(
    scope: str, group_size: int, cluster: ClusterSpec, params: ModelParams
) -> float:
    """The bus bandwidth the cost model prices a group of this scope at
    (`comm.group_bus_bandwidth_bytes_per_s` with the parameter set's bus efficiencies): a node's ranks
    stride 1, one rank per node stride gpus_per_node."""
    from service.costmodel import comm

    links = comm.Links(
        intra_efficiency=params["intra_node_bus_efficiency"],
        inter_efficiency=params["inter_node_bus_efficiency"],
        latency_scale=params["collective_latency_scale"],
    )
    stride = 1 if scope == INTRA else cluster.gpus_per_node
    return float(
        comm.group_bus_bandwidth_bytes_per_s(group_size, stride, cluster.gpus_per_node, cluster.gpu, links)
    )


@dataclass(frozen=True)
class Topology:
    """Which world ranks share a node: `groups[scope]` lists the rank groups of that scope."""

    nodes: int
    groups: dict[str, list[list[int]]]


def topology(node_of_rank: list[Any]) -> Topology:
    """Groups from each rank's node id (any hashable, in rank order): one group per node (intra) and, on
    several nodes, one per local index (inter: the k-th rank of every node)."""
    by_node: dict[Any, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        by_node.setdefault(node, []).append(rank)
    nodes = list(by_node.values())
    groups: dict[str, list[list[int]]] = {INTRA: [g for g in nodes if len(g) > 1]}
    if len(nodes) > 1:
        width = min(len(g) for g in nodes)
        groups[INTER] = [[g[k] for g in nodes] for k in range(width)]
    return Topology(nodes=len(nodes), groups={k: v for k, v in groups.items() if v})


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def time_collective(
    op: str, total_bytes: int, group: Any, ranks: list[int], rank: int, device: Any, warmup: int, repeats: int
) -> float:
    """Mean seconds of one `op` on a `total_bytes` buffer in `group` (this rank is a member of `ranks`).

    Every member runs the same number of calls (no time-based stop, so no member waits on another's
    decision). As service/profile/collectives.py does, the figure is the mean, not the median: a step
    pays every call, gloo's tail included."""
    import torch
    import torch.distributed as dist

    n = len(ranks)
    me = ranks.index(rank)
    elements = max(n, total_bytes // 4) // n * n  # fp32, divisible by the group size
    full = torch.ones(elements, dtype=torch.float32, device=device)
    shard = torch.ones(elements // n, dtype=torch.float32, device=device)
    peer = ranks[me ^ 1] if (me ^ 1) < n else None  # pairs (0,1), (2,3)...; an odd last member idles
    inbox = torch.empty_like(full) if op == SEND_RECV else full

    def once() -> None:
        with warnings.catch_warnings():  # torch 2.13 renames the *_tensor collectives
            warnings.simplefilter("ignore", FutureWarning)
            if op == ALL_REDUCE:
                dist.all_reduce(full, group=group)
            elif op == ALL_GATHER:
                dist.all_gather_into_tensor(full, shard, group=group)
            elif op == REDUCE_SCATTER:
                dist.reduce_scatter_tensor(shard, full, group=group)
            elif op == SEND_RECV:
                if peer is None:
                    return
                out = dist.isend(full, peer, group=group)
                back = dist.irecv(inbox, peer, group=group)
                for request in (out, back):
                    if request is not None:  # None only for a rank outside the group
                        request.wait()
            else:
                raise ValueError(f"unknown collective {op!r}")

    times = []
    dist.barrier(group=group)
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        once()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.fmean(times)


def measure_scope(
    scope: str,
    groups: list[list[int]],
    handles: list[Any],
    ops: list[str],
    total_bytes: int,
    rank: int,
    device: Any,
    warmup: int,
    repeats: int,
) -> dict[str, dict[str, float]]:
    """Times every op in this rank's group of `scope` (all groups of the scope at once), then gathers the
    slowest group's time: {op: {"seconds", "group_size", "bus_gb_per_s", "alg_gb_per_s"}}, the same on
    every rank."""
    import torch
    import torch.distributed as dist

    mine = next((i for i, g in enumerate(groups) if rank in g), None)
    out: dict[str, dict[str, float]] = {}
    for op in ops:
        seconds = 0.0
        if mine is not None:
            seconds = time_collective(
                op, total_bytes, handles[mine], groups[mine], rank, device, warmup, repeats
            )
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest group: every rank must call it
        slowest = float(t.item())
        n = min(len(g) for g in groups)
        busbw = bus_bandwidth_bytes_per_s(op, n, total_bytes, slowest)
        out[op] = {
            "seconds": slowest,
            "group_size": float(n),
            "groups": float(len(groups)),
            "message_bytes": float(total_bytes),
            "alg_gb_per_s": total_bytes / slowest / 1e9 if slowest > 0 else 0.0,
            "bus_gb_per_s": busbw / 1e9,
        }
    return out


def measure_all(
    ops: list[str], total_bytes: int, node_id: Any, device: Any, warmup: int = 3, repeats: int = 20
) -> dict[str, Any]:
    """Inside a running process group: every rank's node (all-gathered), the scope groups, and each op's
    time and bus bandwidth per scope. Every rank must call it; every rank gets the same answer."""
    import torch.distributed as dist

    world = dist.get_world_size()
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, node_id)
    topo = topology(nodes)
    rank = dist.get_rank()
    results: dict[str, Any] = {"nodes": topo.nodes, "world": world, "scopes": {}}
    for scope, groups in topo.groups.items():
        handles = [dist.new_group(g) for g in groups]  # every rank creates every group, in order
        results["scopes"][scope] = measure_scope(
            scope, groups, handles, ops, total_bytes, rank, device, warmup, repeats
        )
    return results
