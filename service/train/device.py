"""Where a proxy worker computes and how its process is set up: device and collective backend (with the
reason when a GPU was asked for and not used), memory cap, collective timeout, seeds."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch

from service.spec.proxy import ProxySpec
from service.spec.units import GIB

GPU_FALLBACK = "GPU resource without a CUDA device: ran on CPU/gloo"
GLOO_FALLBACK = "process group is gloo (not every worker has a CUDA device): ran on CPU/gloo"


def apply_collective_timeout(timeout_s: float) -> None:
    """Makes every process group time out after `timeout_s`, DeepSpeed's subgroups included.

    `torch.distributed.new_group(timeout=None)` falls back to the module default (30 min for gloo,
    10 min for nccl) rather than the world group's timeout, and DeepSpeed creates its data/model-parallel
    groups that way; setting the defaults is the one place that covers all of them.
    """
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=timeout_s)
    distributed_c10d.default_pg_timeout = timeout  # type: ignore[attr-defined]
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = timeout


def cap_memory(limit_gib: float | None, device: torch.device) -> None:
    """Caps what this worker may allocate from now on, so that an oversized plan fails with an OOM error.

    CUDA: `torch.cuda.set_per_process_memory_fraction` (the allocator raises `OutOfMemoryError`).
    CPU: RLIMIT_AS = current address space + limit, i.e. the process may map `limit` more bytes than it
    had after start-up (Python, Ray, torch and DeepSpeed already loaded); allocations past that fail
    with "can't allocate memory".
    """
    if limit_gib is None:
        return
    limit = int(limit_gib * GIB)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        return
    import resource

    with open(f"/proc/{os.getpid()}/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    cap = vm_kib * 1024 + limit
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


class DeviceChoice(NamedTuple):
    """Where a worker computes and which collective backend it uses."""

    device: str  # "cuda" or "cpu"
    backend: str  # "nccl" or "gloo"
    fallback: str = ""  # why a GPU was asked for and not used; empty when none was, or it was used


def choose_device(requested: str, gpu_ids: Sequence[object], cuda_available: bool) -> DeviceChoice:
    """cuda + nccl when the experiment asks for cuda and CUDA is there; cpu + gloo otherwise.

    A GPU was asked for when the experiment says `device: cuda` or Ray assigned this worker GPU ids
    (`ray.get_gpu_ids()`). Without CUDA behind it (Ray's fake multinode provider declares GPUs that
    no device backs) the worker runs on CPU and gloo and says why in `fallback`. A CPU experiment
    given a GPU resource on a CUDA machine still runs on CPU: that is what it asked for.
    """
    if requested == "cuda" and cuda_available:
        return DeviceChoice("cuda", "nccl")
    if (requested == "cuda" or len(gpu_ids) > 0) and not cuda_available:
        return DeviceChoice("cpu", "gloo", GPU_FALLBACK)
    return DeviceChoice("cpu", "gloo")


def _ray_gpu_ids() -> list[object]:
    """The GPU ids Ray assigned this process; none outside a Ray worker (torchrun, the GPU check)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    try:
        return list(ray.get_gpu_ids())
    except Exception:  # not a worker/driver context Ray knows: nothing was assigned here
        return []


def pick_device(proxy: ProxySpec) -> tuple[torch.device, DeviceChoice]:
    """This worker's device and backend (see `choose_device`); warns on stderr when it falls back.

    Under Ray Train the process group already exists; its backend wins (a gloo group means some
    worker had no CUDA, see `trainer.device_aware_torch_config`), so the device follows it.
    """
    import torch.distributed as dist

    choice = choose_device(proxy.device, _ray_gpu_ids(), torch.cuda.is_available())
    if choice.device == "cuda" and dist.is_initialized() and dist.get_backend() != "nccl":
        choice = DeviceChoice("cpu", "gloo", GLOO_FALLBACK)
    if choice.fallback:
        rank = os.environ.get("RANK", "?")
        print(f"WARNING: proxy worker rank {rank}: {choice.fallback}", file=sys.stderr, flush=True)
    if choice.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), choice
    return torch.device("cpu"), choice
