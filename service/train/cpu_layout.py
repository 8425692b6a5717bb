"""Which cores a local Ray's own processes use, and which the proxy workers use.

Ray's processes took 14 % of one core during a 2-worker CPU proxy trial (psutil, benchmarks/README
`proxy_overhead.py`): the Train controller, its synchronisation actor, raylet, GCS and the agents.
Where they share the workers' cores, every interruption of one rank stalls the others at the next
collective. So on a machine with cores to spare, a local Ray keeps its own processes on the last
core(s) and the Train workers on the rest. Linux hands a process's CPU mask down to the processes it
starts (sched_setaffinity(2)), so pinning raylet and GCS pins every worker process raylet starts
later. Each proxy worker then moves itself onto the workers' cores. Those cores are named in
WORKER_CPUS_ENV, in the environment Ray gives its workers.

Below 4 usable cores nothing is reserved. With 2 or 3 cores, reserving one would take a third or half
of the workers' compute to save them about a seventh of one core. A Ray this process did not start
(RAY_ADDRESS) is left as it is.
"""

from __future__ import annotations

import os

from service.spec.errors import SpecError

RAY_CORES_ENV = "SERVICE_RAY_CORES"  # cores for Ray's own processes: unset = automatic, 0 = no pinning
WORKER_CPUS_ENV = "SERVICE_WORKER_CPUS"  # set for the workers by ensure_ray: "0,1,2"
MIN_CORES_TO_RESERVE = 4


def split_cores(cores: list[int], reserve: int | None = None) -> tuple[list[int], list[int]]:
    """(Ray's cores, the workers' cores) out of `cores`; `reserve` overrides the automatic count
    (one core from MIN_CORES_TO_RESERVE up, none below). No pinning is ([], cores). A count that
    leaves no worker core is bad input (SpecError: one line from the CLI)."""
    cores = sorted(cores)
    count = (1 if len(cores) >= MIN_CORES_TO_RESERVE else 0) if reserve is None else reserve
    if not 0 <= count < len(cores):
        usable = f"this process may use {len(cores)} cores"
        raise SpecError(RAY_CORES_ENV, f"must be 0 to {len(cores) - 1} ({usable}), got {count}")
    if count == 0:
        return [], cores
    return cores[-count:], cores[:-count]


def reserve_from_env() -> int | None:
    """RAY_CORES_ENV as a count; None when unset (automatic)."""
    raw = os.environ.get(RAY_CORES_ENV, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise SpecError(RAY_CORES_ENV, f"must be a whole number of cores, got {raw!r}") from None


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_ray_processes(ray_cores: list[int]) -> int:
    """Moves the Ray processes this process started (raylet, GCS, agents, idle workers) onto
    `ray_cores`; returns how many were moved. Processes that exit meanwhile are skipped."""
    import psutil

    moved = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if "ray" not in " ".join(child.cmdline()).lower():
                continue
            child.cpu_affinity(ray_cores)
            moved += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return moved


def pin_to_worker_cores() -> list[int] | None:
    """Moves this process onto the cores named in WORKER_CPUS_ENV; returns them, or None when the
    variable is unset (torchrun, a remote Ray, pinning off)."""
    raw = os.environ.get(WORKER_CPUS_ENV, "").strip()
    if not raw:
        return None
    cores = [int(c) for c in raw.split(",")]
    os.sched_setaffinity(0, cores)
    return cores
