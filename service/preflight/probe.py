"""The preflight's own Ray Train job: on the plan's workers, time the collectives the plan uses and a
checkpoint load and save of the plan's full DeepSpeed state on the cluster's storage.

`probe_loop_per_worker(config)` is what Ray Train runs on every worker (the production run's process
group: gloo on CPU, nccl on GPU). The engine is the production run's own (`service.train.worker.
build_engine` on the same `WorkerConfig` as `ProductionRun` sends); the checkpoint is written and read
with `service.train.checkpoint`, the production run's format. When the production run left a checkpoint
it is loaded first (the real optimizer state, Adam's moments included) and then saved again, timed;
otherwise a fresh engine is saved and read back. Rank 0 writes the answer as JSON to `config["out"]`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

PROBE_FILE = "preflight_probe.json"


def _node_id() -> str:
    """This worker's node: Ray's node id under Ray, else the host name."""
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id())
    except Exception:
        import socket

        return socket.gethostname()


def _tree_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _timed(fn: Any, device: Any) -> float:
    """Seconds from a barrier before `fn` to a barrier after it: the slowest rank's time."""
    import torch.distributed as dist

    from service.preflight.collectives import _sync

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def checkpoint_times(cfg: Any, device: Any, load_from: str | None, save_to: str) -> dict[str, Any]:
    """Builds the plan's engine and times a checkpoint load (`load_from`, if given) and a save to
    `save_to` (then read back when nothing was loaded before); returns seconds and bytes."""
    import torch.distributed as dist

    from service.train import checkpoint
    from service.train.device import seed_everything
    from service.train.worker import build_engine

    rank = dist.get_rank()
    seed_everything(cfg.proxy.seed)
    engine, _ = build_engine(cfg, device)
    out: dict[str, Any] = {"loaded_from": load_from or ""}
    state: dict[str, Any] = {"step": 0, "data": {}}

    def load(directory: str) -> None:
        nonlocal state
        state = checkpoint.load(engine, directory, rank)

    if load_from:
        out["load_s"] = _timed(lambda: load(load_from), device)
    target = Path(save_to)
    if rank == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    step = int(state.get("step", 0))
    out["save_s"] = _timed(lambda: checkpoint.save(engine, target, step, rank, state.get("data", {})), device)
    out["saved_step"] = step
    if not load_from:
        out["load_s"] = _timed(lambda: load(str(target)), device)
        out["loaded_from"] = str(target)
    if rank == 0:
        out["bytes"] = _tree_bytes(target)  # every rank's shards, on shared storage
    dist.barrier()
    return out


def probe_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train entry point: collectives, then the checkpoint; rank 0 writes `config["out"]`."""
    import torch.distributed as dist

    from service.preflight.collectives import measure_all
    from service.train import cpu_layout
    from service.train.device import apply_collective_timeout, pick_device
    from service.train.startup import import_deepspeed
    from service.train.worker import WorkerConfig

    started = time.time()
    cpu_layout.pin_to_worker_cores()
    deepspeed = import_deepspeed()
    cfg = WorkerConfig.model_validate(config["worker"])
    device, choice = pick_device(cfg.proxy)
    apply_collective_timeout(cfg.proxy.collective_timeout_s)
    # Ray Train made the process group; DeepSpeed adopts it but must be told (as run_worker does).
    deepspeed.init_distributed(
        dist_backend=choice.backend, timeout=timedelta(seconds=cfg.proxy.collective_timeout_s)
    )
    rank = dist.get_rank()
    phases = {"imports_s": time.time() - started}
    started = time.time()
    result: dict[str, Any] = {
        "device": device.type,
        "backend": dist.get_backend(),
        "fallback": choice.fallback,
    }
    result["collectives"] = measure_all(
        list(config["ops"]),
        int(config["message_bytes"]),
        _node_id(),
        device,
        warmup=int(config.get("warmup", 3)),
        repeats=int(config.get("repeats", 20)),
    )
    phases["collectives_s"] = time.time() - started
    started = time.time()
    if config.get("checkpoint", True):
        save_to = str(config["save_to"])
        try:
            result["checkpoint"] = checkpoint_times(cfg, device, config.get("load_from"), save_to)
        except Exception as err:  # a checkpoint that cannot be written or read is a finding, not a crash
            result["checkpoint"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
        finally:
            dist.barrier()
            if rank == 0 and not config.get("keep_checkpoint", False):
                shutil.rmtree(save_to, ignore_errors=True)
    phases["checkpoint_s"] = time.time() - started
    result["phases"] = phases
    if rank == 0:
        out = Path(config["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out)
