"""cpu_layout: a local Ray keeps its own processes on a core of their own and the proxy workers on the
rest, where the machine has cores to spare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.train import cpu_layout

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_is_reserved_below_four_cores():
    assert cpu_layout.split_cores([0, 1]) == ([], [0, 1])
    assert cpu_layout.split_cores([2, 0, 1]) == ([], [0, 1, 2])


def test_one_core_for_ray_from_four_cores_up():
    assert cpu_layout.split_cores([3, 0, 2, 1]) == ([3], [0, 1, 2])
    assert cpu_layout.split_cores(list(range(16))) == ([15], list(range(15)))


def test_the_count_can_be_set():
    assert cpu_layout.split_cores([0, 1], reserve=1) == ([1], [0])
    assert cpu_layout.split_cores(list(range(8)), reserve=0) == ([], list(range(8)))
    assert cpu_layout.split_cores(list(range(8)), reserve=2) == ([6, 7], list(range(6)))


@pytest.mark.parametrize("reserve", [2, -1])
def test_a_count_that_leaves_no_worker_core_is_one_line_naming_the_variable(reserve):
    with pytest.raises(ValueError, match=r"^SERVICE_RAY_CORES: must be 0 to 1 \(.*2 cores\), got -?\d$"):
        cpu_layout.split_cores([0, 1], reserve=reserve)


def test_the_count_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(cpu_layout.RAY_CORES_ENV, raising=False)
    assert cpu_layout.reserve_from_env() is None
    monkeypatch.setenv(cpu_layout.RAY_CORES_ENV, " 1 ")
    assert cpu_layout.reserve_from_env() == 1
    monkeypatch.setenv(cpu_layout.RAY_CORES_ENV, "two")
    with pytest.raises(ValueError, match=r"^SERVICE_RAY_CORES: must be a whole number of cores, got 'two'$"):
        cpu_layout.reserve_from_env()


def test_a_worker_moves_onto_the_cores_it_is_given(monkeypatch):
    before = os.sched_getaffinity(0)
    monkeypatch.delenv(cpu_layout.WORKER_CPUS_ENV, raising=False)
    assert cpu_layout.pin_to_worker_cores() is None and os.sched_getaffinity(0) == before
    one = min(before)
    monkeypatch.setenv(cpu_layout.WORKER_CPUS_ENV, str(one))
    try:
        assert cpu_layout.pin_to_worker_cores() == [one]
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, before)


PROBE = """
import json, os, psutil, ray
from service.train import cpu_layout
from service.train.ray_session import ensure_ray
ensure_ray(num_cpus=2)
daemons = [p for p in psutil.Process().children(recursive=True)
           if any(n in " ".join(p.cmdline()) for n in ("raylet", "gcs_server"))]

@ray.remote(num_cpus=1)
def worker_view():
    started_on = sorted(os.sched_getaffinity(0))  # inherited from raylet
    told = os.environ.get(cpu_layout.WORKER_CPUS_ENV)
    return started_on, told, cpu_layout.pin_to_worker_cores(), sorted(os.sched_getaffinity(0))

masks = [sorted(p.cpu_affinity()) for p in daemons]
print(json.dumps({"daemons": masks, "worker": ray.get(worker_view.remote())}))
ray.shutdown()
"""


@pytest.mark.slow
def test_a_local_ray_runs_its_daemons_on_its_core_and_workers_move_to_theirs():
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, cpu_layout.RAY_CORES_ENV: "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(seen["daemons"]) >= 2 and all(mask == cores[-1:] for mask in seen["daemons"])
    started_on, told, pinned, now = seen["worker"]
    assert started_on == cores[-1:]  # a process raylet starts inherits raylet's mask
    assert told == ",".join(map(str, cores[:-1])) and pinned == now == cores[:-1]


def test_a_bad_count_is_one_line_from_the_cli_before_ray_starts():
    env = {**os.environ, cpu_layout.RAY_CORES_ENV: "x"}
    env.pop("RAY_ADDRESS", None)
    args = ["--tp", "1", "--pp", "1", "--zero", "1", "--micro-batch", "2", "--grad-accum", "1"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "proxy-run",
            "experiments/tiny-cpu.yaml",
            *args,
            "--recompute",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: SERVICE_RAY_CORES: must be a whole number of cores, got 'x'"
    ]
