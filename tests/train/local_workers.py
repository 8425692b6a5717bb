"""Worker processes forked from a server that has imported the worker once: what the layout tests run
their gloo processes on, where the process launcher is not what they test.

A proxy trial under Ray Train spends ~9 s of a 2-core machine before its first step (a controller and
one actor per worker, each a fresh Python process importing Ray Train, torch, DeepSpeed and
transformers: benchmarks/proxy_overhead.py), and the step itself a fraction of a second. Tests of what a
layout does (its loss, what it shards, the bytes it saves) run the same worker loop here instead:
`multiprocessing`'s fork server imports `PRELOAD` once per test process, and every worker is forked from
it, so a trial starts in well under a second. Nothing is forked from the test process itself (it may
hold torch's thread pools and Ray's threads, which a fork would copy in an unknown state).

Checkpoints and restarts are kept as Ray Train keeps them: every rank's checkpoint folder of a step is
merged into one folder of the run (`checkpoints/step<N>`), and a restart starts every worker again from
the latest one. Ray Train stays what the trial tests use for everything Ray does: its own restart after
a killed worker, OOM, killed and hang classification, Tune, placement (test_proxy_ray.py's Ray trials).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from service.train.worker import WorkerConfig

# What every worker imports before its first step (service.train.worker's own imports, DeepSpeed and
# the Llama modules it builds the proxy from).
PRELOAD = ("service.train.worker", "deepspeed", "transformers.models.llama.modeling_llama")
CHECKPOINTS = "checkpoints"  # under the run folder: checkpoints/step<N>, every rank's files merged


def start(fn: Callable[..., None], args: Sequence[Any], nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes forked from the preloaded server; returns when all are
    done and raises what one raised (torch.multiprocessing's `ProcessRaisedException`, with its
    traceback) or how one exited."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when the server starts (once)
    mp.start_processes(fn, args=tuple(args), nprocs=nprocs, join=True, start_method="forkserver")


def _worker(rank: int, config: dict[str, Any], world: int, store: str, resume: str | None) -> None:
    import torch.distributed as dist

    from service.train.worker import run_worker

    # What a launcher gives each worker (Ray Train and torchrun alike); the process group is made
    # before the loop, as Ray Train makes it, through a file store (no port to pick or collide on).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    checkpoints = Path(config["run_dir"]) / CHECKPOINTS

    def report(metrics: dict[str, Any], directory: str | None) -> None:
        # rank 0 writes the step log run_proxy reads; a checkpoint is kept as Ray Train keeps one
        if directory is not None:
            shutil.copytree(directory, checkpoints / f"step{int(metrics['step']):06d}", dirs_exist_ok=True)

    try:
        run_worker(config, report, resume_dir=resume)
    finally:
        dist.destroy_process_group()


def launch(config: WorkerConfig, workers: int, restarts: int) -> None:
    """`run_proxy(..., launch=launch)`: the trial's workers as local processes; after a worker dies
    (the others are stopped), up to `restarts` times again from the run's latest checkpoint."""
    checkpoints = Path(config.run_dir) / CHECKPOINTS
    for attempt in range(restarts + 1):
        saved = sorted(checkpoints.glob("step*")) if checkpoints.is_dir() else []
        resume = str(saved[-1]) if saved else None
        with tempfile.TemporaryDirectory(prefix="pg-store-") as folder:
            args = (config.model_dump(mode="json"), workers, os.path.join(folder, "store"), resume)
            try:
                start(_worker, args, workers)
                return
            except Exception:
                if attempt == restarts:
                    raise
