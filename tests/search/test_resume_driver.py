"""A search driver killed mid-search (SIGKILL, as a crash) at a known step of a known trial resumes
with `search --resume PATH`: finished trials are not run again, the running trial resumes from its
Train checkpoint, and MLflow ends up with one parent run and one child run per trial (no duplicates)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from service.search.prune import prune_space
from service.search.space import load_space
from service.search.tuning import STALL_ENV
from service.spec import load_experiment

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 6
STALL_STEP = 5  # the second trial's workers sleep before this step until the driver is killed
CHECKPOINT_STEP = 4  # checkpoint_every=2: the last checkpoint before the stall


def _trials(search_root: Path) -> tuple[Path | None, list[dict]]:
    states = sorted(search_root.glob("*/experiment_state-*.json"))
    if not states:
        return None, []
    try:
        data = json.loads(states[-1].read_text())
    except ValueError:  # being written
        return None, []
    return states[-1].parent, [json.loads(t[0]) for t in data["trial_data"]]


def _starts(run_dir: Path) -> list[int]:
    """Steps at which the trial's Train run (re)started, from rank 0's step log."""
    lines = (run_dir / "proxy_log.jsonl").read_text().splitlines()
    return [int(r["step"]) for r in map(json.loads, lines) if r["event"] == "start"]


def _wait_for_kill_point(
    proc: subprocess.Popen, root: Path, err: Path, stalled_plan: str
) -> tuple[Path, str, str]:
    """Waits until the first trial has ended (as Tune saved it) and the second, whose workers sleep
    before step STALL_STEP (the test hook), has logged step STALL_STEP - 1 and has its checkpoint
    registered; returns (search folder, ended trial, running trial). Nothing here races the trial: it
    cannot move past the stall until it is killed. The deadline only bounds a broken run."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the search ended before it could be killed:\n{err.read_text()[-3000:]}")
        path, trials = _trials(root)
        ended = [t["trial_id"] for t in trials if t["status"] == "TERMINATED"]
        order = (path / "launch_order.txt").read_text().split() if path else []
        launched, keys = order[0::2], order[1::2]  # "trial_id key" per line
        if keys and keys[0] == stalled_plan:
            pytest.fail(f"the stalled plan {stalled_plan} was launched first: launch order {keys}")
        if ended and len(launched) == 2 and launched[0] == ended[0]:
            run_dir = path / "proxy_runs" / f"trial-{launched[1]}"
            snapshot = run_dir / "checkpoint_manager_snapshot.json"
            logged = (run_dir / "proxy_log.jsonl").is_file() and STALL_STEP - 1 in _steps(run_dir)
            if logged and CHECKPOINT_STEP in _checkpoint_steps(snapshot):
                return path, ended[0], launched[1]
        time.sleep(0.2)
    pytest.fail("the kill point was not reached within 600 s")


def _checkpoint_steps(snapshot: Path) -> list[int]:
    """Steps of the checkpoints Ray Train has registered for a run (its checkpoint manager's snapshot)."""
    try:
        results = json.loads(snapshot.read_text())["checkpoint_results"]
    except (OSError, ValueError, KeyError):  # not there yet, or being written
        return []
    return [int(r["metrics"]["step"]) for r in results]


def _steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "proxy_log.jsonl").read_text().splitlines()
    return [int(r["step"]) for r in map(json.loads, lines) if r["event"] == "step"]


def test_killed_driver_resumes_without_rerunning_finished_trials(
    tmp_path, experiment_file, space_file
) -> None:
    experiment = experiment_file("resume", steps=STEPS, checkpoint_every=2)
    space = space_file("resume-space", {"zero_stage": [0, 1], "micro_batch": [2, 4]}, asha=None, steps=STEPS)
    # TPE evaluates the two best-predicted plans first, in model order: the second one is stalled.
    candidates = prune_space(load_experiment(experiment), load_space(space)).candidates
    stalled_plan = candidates[1].key
    root = tmp_path / "searches"
    env = {**os.environ, "SERVICE_SEARCH_DIR": str(root)}
    env.pop("MLFLOW_TRACKING_URI", None)
    stall = {"plan": stalled_plan, "step": STALL_STEP, "seconds": 900}
    cmd = [sys.executable, "-m", "service", "search"]
    err = tmp_path / "first.err"
    with err.open("w") as err_f:
        proc = subprocess.Popen(
            [*cmd, str(experiment), "--space", str(space), "--algorithm", "bayes", "--max-trials", "2"],
            cwd=REPO,
            env={**env, STALL_ENV: json.dumps(stall)},
            stdout=err_f,
            stderr=err_f,
            start_new_session=True,
        )
        try:
            path, ended, running = _wait_for_kill_point(proc, root, err, stalled_plan)
        finally:
            proc.send_signal(signal.SIGKILL)  # the driver dies as in a crash: no clean-up of its own
            proc.wait()
            time.sleep(3)
            with contextlib.suppress(ProcessLookupError):  # Ray processes that driver started
                os.killpg(proc.pid, signal.SIGKILL)
    assert max(_steps(path / "proxy_runs" / f"trial-{running}")) == STALL_STEP - 1  # killed where planned

    resumed = subprocess.run(
        [*cmd, "--resume", str(path), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    data = json.loads(resumed.stdout)

    assert [t["trial_id"] for t in data["trials"]] == [ended, running]
    assert [t["status"] for t in data["trials"]] == ["ok", "ok"]
    assert all(t["steps"] == STEPS and t["measured"]["tokens_per_s"] > 0 for t in data["trials"])
    assert data["best"]["trial_id"] in (ended, running) and data["pruned"] == []
    # The finished trial ran once; the running one restarted once, from the checkpoint before the stall.
    assert _starts(path / "proxy_runs" / f"trial-{ended}") == [0]
    assert _starts(path / "proxy_runs" / f"trial-{running}") == [0, CHECKPOINT_STEP]

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1 and parent[0].info.run_id == data["mlflow_run_id"]
    assert parent[0].info.status == "FINISHED"
    children = sorted(r.data.tags["trial_id"] for r in runs if "trial_id" in r.data.tags)
    assert children == sorted([ended, running])
    for r in runs:
        if "trial_id" in r.data.tags:
            assert r.info.status == "FINISHED" and r.data.tags["trial_status"] == "ok"
