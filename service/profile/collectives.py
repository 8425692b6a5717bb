"""Collectives between CPU proxy workers: gloo all-reduce among `world` local processes, one thread each,
as DeepSpeed's CPU accelerator runs them. Gives the CPU entry's `intra_node_latency_us` and
`intra_node_bandwidth_gb_per_s` (CUDA entries keep their NVLink datasheet figures)."""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

from service.profile.record import CollectiveResult

SIZES = (1, 2**14, 2**20)  # fp32 elements: latency-bound, middle, bandwidth-bound (4 MiB)
MAX_REPEATS = 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, budget_s: float, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[int, tuple[float, int]] = {}
    per_size_s = budget_s / len(SIZES)
    for elements in SIZES:
        x = torch.ones(elements)
        times: list[float] = []
        started = time.perf_counter()
        for i in range(MAX_REPEATS + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if i >= 2:  # two warm-up calls
                times.append(time.perf_counter() - t0)
            # Both ranks must agree on when to stop: rank 0 decides, the others follow.
            stop = torch.tensor([float(len(times) >= 3 and time.perf_counter() - started > per_size_s)])
            dist.broadcast(stop, 0)
            if stop.item():
                break
        results[elements] = (statistics.median(times), len(times))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def gloo_all_reduce(world: int = 2, budget_s: float = 10.0) -> list[CollectiveResult]:
    """Median all-reduce time per message size among `world` spawned processes (their start-up is not
    timed; it is a few seconds of importing torch)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
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
