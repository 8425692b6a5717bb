"""Autoscaling on Ray's fake multinode provider (RAY_FAKE_CLUSTER=1, nodes are processes on this
machine): worker nodes declare GPUs that have no CUDA device behind them. Work that asks for GPUs makes
the autoscaler add nodes (one placement group spanning two nodes, as a 2-node trial does), every task
comes back, and the nodes are removed once idle. Asserts the node count going up and back down.

The work is submitted as a job (its driver runs on the head, as users' jobs do). The head's dashboard
is on 127.0.0.1; the GCS and the fake nodes' raylets advertise the machine's own interface
address (Ray picks it whatever --node-ip-address says; every client here connects to 127.0.0.1).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml
from local_cluster import ray_head

from service.cluster.jobs import submit_job, wait_for_job
from service.tracking.server import free_port

IDLE_TIMEOUT_S = 15


def _fake_cluster_config(path: Path, gcs_port: int) -> Path:
    config = {
        "cluster_name": "fake-gpu",
        "max_workers": 2,
        "idle_timeout_minutes": IDLE_TIMEOUT_S / 60,
        "upscaling_speed": 2.0,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": f"127.0.0.1:{gcs_port}",
        },
        "auth": {"ssh_user": "nobody"},
        # The autoscaler reads these even when, as here, there is nothing to run on the nodes.
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        **{
            k: []
            for k in (
                "initialization_commands",
                "setup_commands",
                "head_setup_commands",
                "worker_setup_commands",
                "head_start_ray_commands",
                "worker_start_ray_commands",
            )
        },
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "gpu-node": {
                "resources": {"CPU": 1, "GPU": 2},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


# Runs against the cluster: a 2-node placement group (one bundle of 2 GPUs per node, STRICT_SPREAD),
# a task in each bundle; then watches the node count until the idle nodes are gone.
DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(log_to_driver=False)  # the job's cluster
    alive = lambda: sum(1 for n in ray.nodes() if n["Alive"])
    counts = [(0.0, alive())]

    from service.cluster.capacity import capacity, max_concurrent_trials
    from service.spec.errors import SpecError
    gpu = capacity("GPU")
    sizing = {"now": gpu.now, "most": gpu.most, "trials_of_2": max_concurrent_trials(2, "cuda")}
    try:
        max_concurrent_trials(8, "cuda")
    except SpecError as err:
        sizing["refused"] = str(err)
    start = time.monotonic()

    @ray.remote(num_gpus=2, num_cpus=0)
    def where(i):
        import os
        return i, ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES")

    pg = placement_group([{"GPU": 2}, {"GPU": 2}], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=240)
    counts.append((time.monotonic() - start, alive()))
    refs = [where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote(i)
            for i in range(2)]
    results = ray.get(refs, timeout=120)
    remove_placement_group(pg)
    up = time.monotonic() - start
    while alive() > 1 and time.monotonic() - start < up + 180:
        time.sleep(2)
        counts.append((time.monotonic() - start, alive()))
    print(json.dumps({"results": results, "counts": counts, "up_s": up, "sizing": sizing}))
    """
)


@pytest.mark.slow
def test_gpu_work_adds_nodes_and_idle_nodes_go(tmp_path: Path):
    port = free_port()  # the fake provider's nodes join the GCS its config names (default: 6379)
    config = _fake_cluster_config(tmp_path / "fake.yaml", port)
    fake = {"RAY_FAKE_CLUSTER": "1"}
    with ray_head(num_cpus=1, extra_args=[f"--autoscaling-config={config}"], env=fake, port=port) as c:
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        (job_dir / "driver.py").write_text(DRIVER)
        # Submitted as a job, as users run things here: its driver runs on the head.
        env = {"SERVICE_AUTOSCALING_CONFIG": str(config)}  # `ray up` leaves ~/ray_bootstrap_config.yaml
        command = ["python", "driver.py"]
        job = submit_job(c.dashboard_url, command, working_dir=job_dir, env=env, token=c.token)
        outcome = wait_for_job(job, timeout_s=420)
    assert outcome.status == "SUCCEEDED", outcome.logs[-3000:]
    out = json.loads(next(line for line in reversed(outcome.logs.splitlines()) if line.startswith("{")))
    counts = [n for _, n in out["counts"]]
    assert counts[0] == 1  # the head alone
    assert max(counts) == 3  # head + the two GPU nodes the placement group needed
    assert counts[-1] == 1  # both removed after the idle timeout
    results = out["results"]
    assert sorted(i for i, _, _ in results) == [0, 1]  # no result lost
    assert len({node for _, node, _ in results}) == 2  # the bundles ran on two different nodes
    assert all(len(cvd.split(",")) == 2 for _, _, cvd in results)  # Ray gave each task its 2 GPU ids
    # Sizing a search from what the autoscaler can add, not from the (zero) GPUs present at the start.
    sizing = out["sizing"]
    assert sizing["now"] == 0 and sizing["most"] == 4 and sizing["trials_of_2"] == 2
    assert "needs 8 GPUs but the Ray cluster offers at most 4 with autoscaling, 0 now" in sizing["refused"]
