"""One real `run` on tiny-cpu shared by the end-to-end, resume and memo-in-a-browser tests.

It is killed once on purpose, as a crash: `python -m service run` starts in a subprocess, its first proxy
trial runs to the end, and its second, whose workers sleep before step STALL_STEP (the search's test
hook, tuning.STALL_ENV), has saved its step-CHECKPOINT_STEP checkpoint. Then the driver's whole process
group (Ray included) is killed, and the run is started again in this process on the same folder. The
tests check that the finished trial was not run again and that the running one resumed from its
checkpoint: the path `Search.restore` takes for `run` and for `search --resume` alike.
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
from service.search.tuning import STALL_ENV
from service.train.proxy_trial import read_log

REPO = Path(__file__).resolve().parents[2]
MAX_PROXIES = 2
STEPS = 8  # a resumed trial still has warm-up and timed steps after its checkpoint
CHECKPOINT_STEP = 4  # proxy.checkpoint_every: the last checkpoint before the stall
STALL_STEP = 5


def tiny_experiment(tmp: Path, name: str = "tiny-run") -> Path:
    data = yaml.safe_load((REPO / "experiments" / "tiny-cpu.yaml").read_text())
    data["name"] = name
    data["proxy"].update({"steps": STEPS, "warmup_steps": 2, "checkpoint_every": CHECKPOINT_STEP})
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
    running: Path  # the Train run folder of the trial that was running (stalled) at the kill

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.tmp / 'mlflow.db'}"


def sensitivity_of(doc: dict, tmp: Path) -> tuple:  # type: ignore[type-arg]
    """An experiment document written under `tmp`, ranked as `run` ranks it and put through the
    sensitivity scenarios: (the nominal `Scored`, the `Sensitivity`, the row chosen)."""
    from service.design.decide import score
    from service.design.sensitivity import sensitivity
    from service.spec import load_experiment
    from service.spec.params import load_params

    path = tmp / "variant.yaml"
    path.write_text(yaml.safe_dump(doc))
    spec, params = load_experiment(path), load_params(None)
    nominal = score(spec.model, spec.cluster, spec.workload, spec.budget, params, spec.goodput)
    sens, chosen = sensitivity(nominal, spec.model, spec.workload, spec.budget, params, spec.goodput)
    return nominal, sens, chosen


def stalled_plan(experiment: Path, out: Path) -> str:
    """The search key of the run's second proxy plan: what `run` would launch second (the first is
    left to finish)."""
    from service.design import steps
    from service.design.job import Run

    class Chooser(Run):  # the run's own choice of proxies, without running them
        def _proxies(self, proxy_exp, choices):  # type: ignore[no-untyped-def]
            self.choices = choices
            return None, None

    run = Chooser(experiment, storage_path=out.parent / "choose", max_proxies=MAX_PROXIES)
    run._run_proxies(steps.rank_prior(run.spec, run.params))
    assert len(run.choices) == MAX_PROXIES, run.choices
    return run.choices[1].proxy_plan.short()


def _kill_point(out: Path) -> tuple[list[Path], Path] | None:
    """(finished trials' outcome files, the running trial's run folder) once the first trial has ended
    as Tune saved it and the second has logged step STALL_STEP - 1 with its checkpoint registered."""
    done = sorted(out.glob("search/*/proxy_runs/trial-*/outcome.json"))
    if len(done) != 1 or not _tune_saved(done):
        return None
    running = [p for p in done[0].parents[1].glob("trial-*") if p != done[0].parent]
    if len(running) != 1:
        return None
    snapshot = running[0] / "checkpoint_manager_snapshot.json"
    try:
        registered = [
            int(r["metrics"]["step"]) for r in json.loads(snapshot.read_text())["checkpoint_results"]
        ]
    except (OSError, ValueError, KeyError):  # not there yet, or being written
        return None
    try:
        records, _ = read_log(running[0])
    except ValueError:  # a line being written
        return None
    logged = [int(r["step"]) for r in records]
    if CHECKPOINT_STEP in registered and STALL_STEP - 1 in logged:
        return done, running[0]
    return None


def _kill_at_the_stall(experiment: Path, out: Path, timeout_s: float = 500) -> tuple[list[Path], Path]:
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
    stall = {"plan": stalled_plan(experiment, out), "step": STALL_STEP, "seconds": 900}
    env = {**os.environ, STALL_ENV: json.dumps(stall)}
    log = (out.parent / "killed-run.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    point = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            point = _kill_point(out)
            if point is not None:
                # Stop the driver, and kill it only while Tune's saved state is whole: Tune rewrites it
                # in place every 2 s, and a kill during a write cuts it off (the search is then not
                # continued: service.search.state.tune_state_problem).
                os.killpg(proc.pid, signal.SIGSTOP)
                if _tune_saved(point[0]):
                    break
                os.killpg(proc.pid, signal.SIGCONT)
                point = None
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_session(proc.pid)
        log.close()
    if point is None:
        pytest.fail(f"the kill point was not reached:\n{(out.parent / 'killed-run.log').read_text()[-3000:]}")
    return point


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
    finished, running = _kill_at_the_stall(experiment, out)
    mtimes = {str(p): p.stat().st_mtime for p in finished}
    result = Run(experiment, storage_path=out, max_proxies=MAX_PROXIES).fit()
    return TinyRun(result, experiment, out, tmp, finished, mtimes, running)
