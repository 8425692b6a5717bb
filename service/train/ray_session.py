"""`ensure_ray`: the one way this service connects to Ray (proxy runs, searches, the CLI).

Connects to RAY_ADDRESS when it is set; otherwise starts a local Ray bound to 127.0.0.1 whose own
processes get RAY_ADDRESS pointing at it. Without that, Ray Train's placement-group cleaner (it asks
the State API whether the trial's controller is alive) finds "the latest Ray started with `ray start`"
on a shared machine, i.e. someone else's cluster, does not see our controller there and removes our
running trial's placement group, killing its workers. Worker logs are not streamed to the driver
(`log_to_driver=False`): they stay in Ray's session logs, and the driver's stdout stays the command's.
On a machine with 4 or more usable cores, a local Ray's own processes get one core of their own and
the proxy workers the rest (`cpu_layout.py`; SERVICE_RAY_CORES sets the count, 0 turns it off).
"""

from __future__ import annotations

import os
import socket

from service.train import cpu_layout


def _free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_ray(num_cpus: int, num_gpus: int | None = None) -> bool:
    """Connects to or starts Ray unless this process already has; True when this call did (the
    caller then owns the session and shuts it down).

    Args:
        num_cpus: logical CPUs of a local Ray (ignored when connecting to RAY_ADDRESS).
        num_gpus: GPU resources of a local Ray (default: what Ray detects). Tests declare GPUs with
            no device behind them, as Ray's fake multinode provider does, to exercise the CPU fallback.
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return True
    # Ray's own processes on a core of their own where the machine has cores to spare (cpu_layout.py)
    ray_cores, worker_cores = cpu_layout.split_cores(cpu_layout.usable_cores(), cpu_layout.reserve_from_env())
    port = _free_local_port()
    env_vars = {"RAY_ADDRESS": f"127.0.0.1:{port}"}
    if ray_cores:
        env_vars[cpu_layout.WORKER_CPUS_ENV] = ",".join(map(str, worker_cores))
    previous = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)  # read by Ray's node start-up (ray/_private/node.py)
    try:
        # No dashboard: what it would clean up for stopped trials (their placement groups), the
        # search's own PlacementGroupSweeper does without it (see search/stopping.py).
        ray.init(
            address="local",  # new, even where `ray start` wrote /tmp/ray/ray_current_cluster
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            runtime_env={"env_vars": env_vars},
        )
    finally:
        if previous is None:
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = previous
    if ray_cores:
        cpu_layout.pin_ray_processes(ray_cores)
    return True
