"""One real `run` on tiny-cpu shared by the end-to-end, resume and memo-in-a-browser tests.

It is killed once on purpose: `python -m service run` starts in a subprocess, is killed (its whole
process group, Ray included) as soon as its first proxy trial has finished and Tune has saved it, and is
then run again in this process on the same folder. The tests check that the finished trial was not run
again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from service.report.result import RunResult

REPO = Path(__file__).resolve().parents[2]
MAX_PROXIES = 2


def tiny_experiment(tmp: Path, name: str = "tiny-run") -> Path:
    data = yaml.safe_load((REPO / "experiments" / "tiny-cpu.yaml").read_text())
    data["name"] = name
    data["proxy"].update({"steps": 4, "warmup_steps": 2})
    data["tracking"] = {
        "uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "experiment_name": name,
        "buffer_dir": str(tmp / "pending"),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@dataclass
class TinyRun:
    result: RunResult
    experiment: Path
    out: Path
    tmp: Path
    killed_after: list[Path]  # outcome files of the trials that had finished when the run was killed
    mtimes: dict[str, float]  # their modification times at the kill

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.tmp / 'mlflow.db'}"


def _kill_after_first_trial(experiment: Path, out: Path, timeout_s: float = 400) -> list[Path]:
    cmd = [
        sys.executable,
        "-m",
        "service",
        "run",
        str(experiment),
        "--out",
        str(out),
        "--max-proxies",
        str(MAX_PROXIES),
        "--json",
    ]
    log = (out.parent / "killed-run.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    done: list[Path] = []
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            done = sorted(out.glob("search/*/proxy_runs/trial-*/outcome.json"))
            if done and _tune_saved(done):
                # Stop the driver, and kill it only while Tune's saved state is whole: Tune rewrites it
                # in place every 2 s, and a kill during a write cuts it off (the search is then not
                # continued: service.search.state.tune_state_problem).
                os.killpg(proc.pid, signal.SIGSTOP)
                if _tune_saved(done):
                    break
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_session(proc.pid)
        log.close()
    return done


def _tune_saved(finished: list[Path]) -> bool:
    """Whether Tune's newest saved state (whole JSON) lists every finished trial as TERMINATED."""
    folder = finished[0].parents[2]  # search/<name>/proxy_runs/trial-<id>/outcome.json
    states = sorted(folder.glob("experiment_state-*.json"))
    try:
        trials = [json.loads(t[0]) for t in json.loads(states[-1].read_text())["trial_data"]]
    except (IndexError, OSError, ValueError, KeyError):
        return False
    ended = {t["trial_id"] for t in trials if t["status"] == "TERMINATED"}
    return {p.parent.name.removeprefix("trial-") for p in finished} <= ended


def _kill_session(sid: int) -> None:
    """Kills what is left of the killed run's session: Ray's raylet, GCS and workers may sit in process
    groups of their own, and a worker left running would go on writing into the run's folder while the
    restarted run uses it (a restarted run once waited on a trial such a worker had finished)."""
    import psutil

    left = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                p.kill()
                left.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    psutil.wait_procs(left, timeout=10)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> TinyRun:
    from service.design.job import Run

    tmp = tmp_path_factory.mktemp("tiny-run")
    experiment = tiny_experiment(tmp)
    out = tmp / "out"
    finished = _kill_after_first_trial(experiment, out)
    mtimes = {str(p): p.stat().st_mtime for p in finished}
    result = Run(experiment, storage_path=out, max_proxies=MAX_PROXIES).fit()
    return TinyRun(result, experiment, out, tmp, finished, mtimes)
