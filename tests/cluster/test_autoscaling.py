"""Autoscaling on Ray's fake multinode provider (RAY_FAKE_CLUSTER=1: "nodes" are raylets on this
machine): a search whose trials ask for GPUs makes the autoscaler add GPU nodes, its trial spans two of
them, every trial's result comes back, and the nodes are removed once idle.

The cluster: a head with 1 CPU and no GPU (the trials' Tune drivers ask 0.01 CPU each), and a worker
node type of {CPU: 2, GPU: 1}, 0 to 2 nodes. The experiment is tiny-cpu with
`proxy.device: cuda`, so each of a trial's 2 Ray Train workers asks {CPU: 1, GPU: 1}: no node holds
two, so every trial needs both GPU nodes at once. The GPUs have no CUDA device behind them; the workers
fall back to CPU and gloo (`choose_device`, `device_aware_torch_config`) and say so (`device_fallback`).

The search runs as users run it: `python -m service search ... --json`, inside a job submitted to the
head. The job's own driver (DRIVER below) starts it, counts the alive nodes every second meanwhile and
until the GPU nodes are gone, and afterwards asks Ray's state API on which node each Ray Train worker
actor ran (the GCS keeps dead actors, with their node and placement group).

What it shows: the autoscaler scales from the head alone to head + 2 GPU nodes for the trials and back
to the head after `idle_timeout_minutes`; the search sizes its concurrency from what the autoscaler
can add (service/cluster/capacity.py), not from the 0 GPUs present at the start; each trial's two
workers were placed on two different GPU nodes; every trial ends `ok` with its measured metrics and
the CPU fallback in the search's JSON. The measurements reach the search through Ray: each worker's
`ray.train.report` goes to the Train controller, then to the trial's Tune actor, then to the Tune
driver, which is what `Search` reads. What it cannot show: on one machine every "node" shares one disk
and one network interface, so a path that only works with a shared file system (the Train storage path,
the runs' step logs the search reads on restore) or with reachable node addresses across machines
would pass here and could still fail on a real multi-node cluster without shared storage.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import yaml
from local_cluster import ray_head
from manifest_checks import ROOT

from service.cluster.jobs import submit_job, wait_for_job
from service.cluster.ports import free_port
from service.train.device import GPU_FALLBACK

IDLE_TIMEOUT_S = 15
STEPS = 3


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
            # One GPU per node: a 2-worker trial (each worker asks CPU 1 + GPU 1) cannot run unless it
            # spans two nodes. The spare CPU is for a Tune trial driver (0.01 CPU), which Ray may place
            # on an idle GPU node: on {CPU: 1, GPU: 1} that node is left with 0.99 CPU, no worker fits,
            # and the trial waits for a third node the cluster cannot have (seen: it ended
            # unschedulable). Real GPU nodes have many CPUs per GPU, as here.
            "gpu-node": {
                "resources": {"CPU": 2, "GPU": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _search_files(job_dir: Path) -> None:
    """tiny-cpu with GPU workers, 3 steps; a space of one plan (ZeRO 1): one 2-worker trial shows the
    scale-up, the two-node placement and the scale-down (a second trial would only repeat them)."""
    experiment = yaml.safe_load((ROOT / "experiments/tiny-cpu.yaml").read_text())
    experiment["name"] = "tiny-fake-gpu"
    experiment["proxy"].update({"device": "cuda", "steps": STEPS, "warmup_steps": 1, "memory_limit_gib": 2})
    experiment["tracking"] = {"experiment_name": "tiny-fake-gpu"}  # the store: MLFLOW_TRACKING_URI
    space = {"name": "fake-gpu", "params": {"zero_stage": [1], "offload_optimizer": [False], "tp": [1],
             "micro_batch": [2], "grad_accum": [1], "recompute": ["none"]},
             # No ASHA: this test checks that the trial ran to the end, not whether a rung stops it.
             "search": {"algorithm": "grid", "steps": STEPS, "trial_timeout_s": 240,
                        "asha": None}}  # fmt: skip
    (job_dir / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    (job_dir / "space.yaml").write_text(yaml.safe_dump(space))


# The job's driver: sizing, then the search (the CLI, in a child process that finds the cluster through
# RAY_ADDRESS, as the job gives it), the node count meanwhile, where the Train workers ran, and the node
# count until the GPU nodes are gone. One JSON line at the end.
DRIVER = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    import ray
    from ray.util.state import list_actors
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        AUTOSCALING_REQUESTS_EXPIRE_TIME_S,
    )
    # A trial's Ray Train controller cancels its resource request when it shuts down; a trial stopped
    # mid-run (ASHA, a hang) takes its controller down without that, and the request then holds the
    # GPU nodes until it expires (seen in CI: nodes up for the whole 180 s the test used to wait).
    SCALE_DOWN_WAIT_S = AUTOSCALING_REQUESTS_EXPIRE_TIME_S + 60

    ray.init(log_to_driver=False)  # the job's cluster
    start = time.monotonic()
    counts, gpu_nodes, head = [], set(), ray.get_runtime_context().get_node_id()

    def look():
        alive = [n for n in ray.nodes() if n["Alive"]]
        gpu_nodes.update(n["NodeID"] for n in alive if n["Resources"].get("GPU"))
        counts.append((round(time.monotonic() - start, 1), len(alive)))

    look()
    from service.cluster.capacity import capacity, max_concurrent_trials
    from service.spec.errors import SpecError
    gpu = capacity("GPU")
    sizing = {"now": gpu.now, "most": gpu.most, "trials_of_2": max_concurrent_trials(2, "cuda")}
    try:
        max_concurrent_trials(4, "cuda")
    except SpecError as err:
        sizing["refused"] = str(err)

    stop = threading.Event()
    def watch():
        while not stop.wait(1.0):
            look()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cmd = [sys.executable, "-m", "service", "search", "experiment.yaml", "--space", "space.yaml",
           "--pending-timeout", "180", "--json"]
    # Not in the job's working dir: each fake node's runtime-env agent unpacks the job's working dir
    # afresh (rmtree, then unzip) into the session folder all of them share with the head, which
    # deletes the directory a process there has as its cwd, and Tune's last os.getcwd() then fails.
    here = os.environ["JOB_FILES"]
    search = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=here)
    search_s = time.monotonic() - start
    workers = [{"node": a.node_id, "pg": a.placement_group_id, "state": a.state}
               for a in list_actors(filters=[("class_name", "=", "RayTrainWorker")], detail=True,
                                    limit=1000, raise_on_missing_output=False)]
    while counts[-1][1] > 1 and time.monotonic() - search_s - start < SCALE_DOWN_WAIT_S:
        time.sleep(1)
    stop.set()
    watcher.join()
    print(json.dumps({"rc": search.returncode, "search": search.stdout, "stderr": search.stderr[-3000:],
                      "counts": counts, "gpu_nodes": sorted(gpu_nodes), "head": head,
                      "workers": workers, "search_s": search_s, "sizing": sizing}))
    """
)


@pytest.mark.slow
def test_gpu_search_adds_nodes_spans_two_and_idle_nodes_go(tmp_path: Path):
    port = free_port()  # the fake provider's nodes join the GCS its config names (default: 6379)
    config = _fake_cluster_config(tmp_path / "fake.yaml", port)
    fake = {"RAY_FAKE_CLUSTER": "1"}
    with ray_head(num_cpus=1, extra_args=[f"--autoscaling-config={config}"], env=fake, port=port) as c:
        job_dir = tmp_path / "job"
        job_dir.mkdir()
        (job_dir / "driver.py").write_text(DRIVER)
        _search_files(job_dir)
        env = {
            "SERVICE_AUTOSCALING_CONFIG": str(config),  # `ray up` leaves ~/ray_bootstrap_config.yaml
            "SERVICE_SEARCH_DIR": str(tmp_path / "searches"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "JOB_FILES": str(job_dir),  # the search's files, outside the job's working dir (see DRIVER)
        }
        job = submit_job(
            c.dashboard_url, ["python", "driver.py"], working_dir=job_dir, env=env, token=c.token
        )
        outcome = wait_for_job(job, timeout_s=540)
    assert outcome.status == "SUCCEEDED", outcome.logs[-3000:]
    out = json.loads(next(line for line in reversed(outcome.logs.splitlines()) if line.startswith("{")))
    assert out["rc"] == 0, out["stderr"]
    print(f"search {out['search_s']:.0f} s; nodes {out['counts']}")

    counts = [n for _, n in out["counts"]]
    assert counts[0] == 1  # the head alone
    assert max(counts) == 3  # head + the two GPU nodes a trial needs
    assert counts[-1] == 1  # both removed after the idle timeout

    # Every trial came back, ok, measured, and says it ran on CPU for want of CUDA.
    result = json.loads(out["search"])
    trials = result["trials"]
    assert [t["plan"]["zero_stage"] for t in trials] == [1]
    for t in trials:
        assert t["status"] == "ok" and t["steps"] == STEPS, t
        assert t["measured"]["tokens_per_s"] > 0 and math.isfinite(t["measured"]["loss"]), t
        assert t["device_fallback"] == GPU_FALLBACK, t
    assert result["best"] is not None

    # Where Ray placed the Train workers: per trial (one placement group each), two GPU nodes.
    by_group: dict[str, set[str]] = {}
    for w in out["workers"]:
        by_group.setdefault(w["pg"], set()).add(w["node"])
    assert len(by_group) == len(trials), out["workers"]
    for nodes in by_group.values():
        assert len(nodes) == 2 and nodes <= set(out["gpu_nodes"]) and out["head"] not in nodes

    # Sizing a search from what the autoscaler can add, not from the (zero) GPUs present at the start.
    sizing = out["sizing"]
    assert sizing["now"] == 0 and sizing["most"] == 2 and sizing["trials_of_2"] == 1
    assert "needs 4 GPUs but the Ray cluster offers at most 2 with autoscaling, 0 now" in sizing["refused"]
