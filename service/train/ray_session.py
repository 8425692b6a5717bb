"""`ensure_ray`: the one way this service connects to Ray (proxy runs, searches, the CLI).

Connects to RAY_ADDRESS when it is set; otherwise starts a local Ray bound to 127.0.0.1 whose own
processes get RAY_ADDRESS pointing at it. Without that, Ray Train's placement-group cleaner (it asks
the State API whether the trial's controller is alive) finds "the latest Ray started with `ray start`"
on a shared machine, i.e. someone else's cluster, does not see our controller there and removes our
running trial's placement group, killing its workers. Worker logs are not streamed to the driver
(`log_to_driver=False`): they stay in Ray's session logs, and the driver's stdout stays the command's.
On a machine with 4 or more usable cores, a local Ray's own processes get one core of their own and
the proxy workers the rest (`cpu_layout.py`; SERVICE_RAY_CORES sets the count, 0 turns it off).

A local Ray listens on loopback only: its GCS, raylet, workers, agents and metrics servers bind to
127.0.0.1 (`_loopback_node_ip`; a cluster is reached through RAY_ADDRESS). And Ray Tune copies no
credentials into its trials' runtime envs, which Ray's runtime-env agent would write to its log in plain
text (`service.cluster.secrets`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from service.cluster.ports import free_port
from service.cluster.secrets import keep_secrets_out_of_trials
from service.train import cpu_layout


@contextmanager
def _loopback_node_ip() -> Iterator[None]:
    """While it lasts, `ray.init(_node_ip_address="127.0.0.1")` keeps 127.0.0.1.

    Ray 2.60's `ray.init` passes `_node_ip_address` through `services.resolve_ip_for_localhost`
    (ray/_private/worker.py), which swaps a loopback address for `get_node_ip_address()`: the address of
    the machine's default route, unless `ray_constants.ENABLE_RAY_CLUSTER` is off (ray/_private/
    services.py; it is off only on macOS/Windows, from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER read at import).
    Every listener then follows that node IP: the GCS, raylet and worker gRPC servers bind to all
    interfaces unless it is loopback, the dashboard agent's gRPC server and the autoscaler's and
    dashboard's metrics servers take all interfaces or loopback by `is_localhost(node IP)`
    (dashboard/agent.py, autoscaler/_private/monitor.py, dashboard/head.py), and the runtime-env agent
    binds to the node IP itself (_private/runtime_env/agent/main.py). Once Ray has started, its node
    answers `get_node_ip_address()` itself, so the switch is restored right after `ray.init`.
    """
    from ray._private import ray_constants

    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous


def ensure_ray(num_cpus: int, num_gpus: int | None = None) -> bool:
    """Connects to or starts Ray unless this process already has; True when this call did (the
    caller then owns the session and shuts it down).

    Args:
        num_cpus: logical CPUs of a local Ray (ignored when connecting to RAY_ADDRESS).
        num_gpus: GPU resources of a local Ray (default: what Ray detects). Tests declare GPUs with
            no device behind them, as Ray's fake multinode provider does, to exercise the CPU fallback.
    """
    import ray

    keep_secrets_out_of_trials()  # before any Tuner exists, whoever started Ray
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return True
    # Ray's own processes on a core of their own where the machine has cores to spare (cpu_layout.py)
    ray_cores, worker_cores = cpu_layout.split_cores(cpu_layout.usable_cores(), cpu_layout.reserve_from_env())
    port = free_port()
    env_vars = {"RAY_ADDRESS": f"127.0.0.1:{port}"}
    if ray_cores:
        env_vars[cpu_layout.WORKER_CPUS_ENV] = ",".join(map(str, worker_cores))
    previous = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)  # read by Ray's node start-up (ray/_private/node.py)
    try:
        with _loopback_node_ip():
            # No dashboard: what it would clean up for stopped trials (their placement groups), the
            # search's own PlacementGroupSweeper does without it (see search/stopping.py).
            ray.init(
                address="local",  # new, even where `ray start` wrote /tmp/ray/ray_current_cluster
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                include_dashboard=False,
                dashboard_host="127.0.0.1",  # the default; its head process starts all the same (usage stats)
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
