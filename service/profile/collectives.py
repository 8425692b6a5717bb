"""Collectives between CPU proxy workers: gloo all-reduce among `world` local processes, one thread each,
as DeepSpeed's CPU accelerator runs them. Gives the CPU entry's `intra_node_latency_us` and
`intra_node_bandwidth_gb_per_s` (CUDA entries keep their NVLink datasheet figures).

Timed as training issues them: each call follows a short burst of compute on every rank (DeepSpeed's
ZeRO 1-2 reduce a bucket from a backward hook, between layers' kernels; `overlap_comm` is off on CPU),
and the figure is the MEAN call time, not the median. Over loopback TCP, gloo's calls have a heavy tail
(a 64 KiB all-reduce on this project's 2-core machine: median 0.44-0.60 ms, mean 1.0-1.6 ms, some
calls several ms), and a step pays the sum of its calls, i.e. count × mean. The previous protocol (a
barrier before each call, the median) gave 0.39-0.53 ms where DeepSpeed's own calls in a dp=2 proxy
step took 1.6-2.0 ms each.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from service.cluster.ports import free_port
from service.profile.record import CollectiveResult

SIZES = (1, 2**14, 2**20)  # fp32 elements: latency-bound, middle, bandwidth-bound (4 MiB)
MAX_REPEATS = 60
# Compute each rank runs before a call (a 256×256×256 fp32 matmul, ~0.1-0.5 ms on one core): the call
# starts from a busy rank, with the skew between ranks that brings, as in a backward pass.
COMPUTE_SIDE = 256


def _worker(rank: int, world: int, port: int, budget_s: float, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[int, tuple[float, int]] = {}
    per_size_s = budget_s / len(SIZES)
    a = torch.randn(COMPUTE_SIDE, COMPUTE_SIDE)
    for elements in SIZES:
        x = torch.ones(elements)
        times: list[float] = []
        started = time.perf_counter()
        dist.barrier()
        for i in range(MAX_REPEATS + 2):
            a @ a  # the compute a backward runs between two bucket reductions
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if i >= 2:  # two warm-up calls
                times.append(time.perf_counter() - t0)
            if i % 4 == 3:  # both ranks must agree on when to stop: rank 0 decides, the others follow
                stop = torch.tensor([float(len(times) >= 8 and time.perf_counter() - started > per_size_s)])
                dist.broadcast(stop, 0)
                if stop.item():
                    break
        results[elements] = (statistics.fmean(times), len(times))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def gloo_all_reduce(world: int = 2, budget_s: float = 10.0) -> list[CollectiveResult]:
    """Mean all-reduce time per message size among `world` spawned processes (their start-up is not
    timed; it is a few seconds of importing torch)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, budget_s, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = queue.get()
    for p in procs:
        p.join(timeout=30)
    return [
        CollectiveResult(
            op="all_reduce",
            backend="gloo",
            world=world,
            elements=elements,
            bytes=4 * elements,
            seconds=seconds,
            repeats=repeats,
        )
        for elements, (seconds, repeats) in sorted(results.items())
    ]
