"""A search driver killed mid-search (SIGKILL, as a crash) resumes with `search --resume PATH`:
finished trials are not run again, the running trial resumes from its Train checkpoint, and MLflow
ends up with one parent run and one child run per trial (no duplicates)."""

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

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


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


def _wait_for_kill_point(proc: subprocess.Popen, root: Path, err: Path) -> tuple[Path, str, str]:
    """Waits until the first trial has ended (as Tune saved it) and the second has a registered
    checkpoint (Train's snapshot file); returns (search folder, ended trial, running trial)."""
    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the search ended before it could be killed:\n{err.read_text()[-3000:]}")
        path, trials = _trials(root)
        ended = [t["trial_id"] for t in trials if t["status"] == "TERMINATED"]
        order = (path / "launch_order.txt").read_text().split() if path else []
        launched = order[0::2]  # "trial_id key" per line
        if ended and len(launched) == 2 and launched[0] == ended[0]:
            running = launched[1]
            if (path / "proxy_runs" / f"trial-{running}" / "checkpoint_manager_snapshot.json").is_file():
                return path, ended[0], running
        time.sleep(0.2)
    pytest.fail("no trial ended within 420 s")


def test_killed_driver_resumes_without_rerunning_finished_trials(
    tmp_path, experiment_file, space_file
) -> None:
    # 16 steps: after the first checkpoint (step 2) the trial runs for seconds more, time to kill it.
    experiment = experiment_file("resume", steps=16, checkpoint_every=2)
    space = space_file("resume-space", {"zero_stage": [0, 1], "micro_batch": [2, 4]}, asha=None, steps=16)
    root = tmp_path / "searches"
    env = {**os.environ, "SERVICE_SEARCH_DIR": str(root)}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "service", "search"]
    err = tmp_path / "first.err"
    with err.open("w") as err_f:
        proc = subprocess.Popen(
            [*cmd, str(experiment), "--space", str(space), "--algorithm", "bayes", "--max-trials", "2"],
            cwd=REPO,
            env=env,
            stdout=err_f,
            stderr=err_f,
            start_new_session=True,
        )
        try:
            path, ended, running = _wait_for_kill_point(proc, root, err)
        finally:
            proc.send_signal(signal.SIGKILL)  # the driver dies as in a crash: no clean-up of its own
            proc.wait()
            time.sleep(3)
            with contextlib.suppress(ProcessLookupError):  # Ray processes that driver started
                os.killpg(proc.pid, signal.SIGKILL)

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
    assert all(t["steps"] == 16 and t["measured"]["tokens_per_s"] > 0 for t in data["trials"])
    assert data["best"]["trial_id"] in (ended, running) and data["pruned"] == []
    # The finished trial ran once; the running one restarted once, from its step-2 (or later) checkpoint.
    assert _starts(path / "proxy_runs" / f"trial-{ended}") == [0]
    starts = _starts(path / "proxy_runs" / f"trial-{running}")
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 2

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
