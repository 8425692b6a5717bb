"""The per-trial driver: one Tune trial builds the proxy `TorchTrainer` for its plan and runs it.

Workers report every step through `ray.train.report`; `TuneReportCallback` forwards each report to
this trial, so Tune (ASHA, the searcher, the MLflow callback) sees every step (the worker's `done`
flag arrives as `last_step`: see `report_callback`). The Train run is named
after the trial id, so when a killed search is restored and Tune restarts this trial, the
`TorchTrainer` finds its own run and resumes from the latest checkpoint.

However the run ends, the trial's last report says how: `trial_status` (ok, oom, failed, invalid)
and `trial_reason`; a failing plan is a result of the search, not an error of it. A run still going
after the trial timeout is the one exception: the trial raises `TrialHang` (a report would queue
behind the run's own), and the search records it as `hang`.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan

TRIAL_LOG = "trial.log"
OUTCOME_FILE = "outcome.json"
LAST_STEP = "last_step"  # the worker's `done` flag, renamed on its way to Tune (see report_callback)


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one search shares (sent once to the object store by `tune.with_parameters`)."""

    experiment: ExperimentSpec
    plans: dict[str, dict[str, Any]]  # key -> Plan fields
    runs_path: str  # storage_path of the TorchTrainer runs
    steps: int | None
    timeout_s: float
    stall: dict[str, Any] | None = None  # test hook: {"plan": key, "step", "seconds"} (see tuning.STALL_ENV)


class TrialHang(RuntimeError):
    """A trial whose run did not end within the search's trial timeout; its message starts `hang:`."""


def train_run_name(trial_id: str) -> str:
    return f"trial-{trial_id}"


def report_callback() -> Any:
    """`TuneReportCallback` that renames the worker's `done` flag to `last_step`.

    Tune ends a trial on a report with `done` set, killing the `TorchTrainer` while it shuts down. So
    the trial ends when `fit()` returns, and this function reports how it went.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class _ReportToTune(TuneReportCallback):
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            renamed = [{(LAST_STEP if k == "done" else k): v for k, v in m.items()} for m in metrics]
            super().after_report(run_context, renamed, checkpoint)

    return _ReportToTune()


def _log(path: Path, message: str) -> None:
    with path.open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")


def _fit(trainer: Any, timeout_s: float, log_path: Path) -> tuple[str, str]:
    """Runs `trainer.fit()`; (status, reason). A run still going after `timeout_s` is a hang.

    The hung run is left to die with this trial's process: Tune ends the trial actor once this
    function returns, and the Train controller and its workers go with the actor that owns them.
    """
    from service.train.run import classify_failure

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            trainer.fit()
        except BaseException as err:
            outcome["error"] = err
            outcome["trace"] = traceback.format_exc()

    thread = threading.Thread(target=target, name="proxy-fit", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "hang", f"hang: the trial did not finish within {timeout_s:g} s"
    if "error" in outcome:
        _log(log_path, f"the run raised:\n{outcome['trace']}")
        return classify_failure(outcome["error"])
    return "ok", ""


def run_trial(config: dict[str, Any], setup: TrialSetup) -> None:
    """Tune function trainable: `config` is `{"plan": key}` from `PlanSearcher`."""
    import ray.tune

    from service.train.trainer import build_trainer

    context = ray.tune.get_context()
    trial_id = context.get_trial_id()
    log_path = Path(context.get_trial_dir()) / TRIAL_LOG
    plan = Plan.model_validate(setup.plans[config["plan"]])
    run_dir = Path(setup.runs_path) / train_run_name(trial_id)
    earlier = _earlier_outcome(run_dir, setup.steps or setup.experiment.proxy.steps)
    if earlier is not None:  # the driver died after this trial ended but before Tune saved that
        _log(log_path, f"trial {trial_id}: ended before the driver restarted ({earlier[0]}); not run again")
        if earlier[2]:  # its last step's report, from the worker's step log, so the measurement is kept
            ray.tune.report({(LAST_STEP if k == "done" else k): v for k, v in earlier[2].items()})
        ray.tune.report({"trial_status": earlier[0], "trial_reason": earlier[1], "done": 1.0})
        return
    _log(log_path, f"trial {trial_id}: plan {plan.short()} {plan.model_dump_json()}")
    try:
        trainer = build_trainer(
            setup.experiment,
            plan,
            run_name=train_run_name(trial_id),
            storage_path=setup.runs_path,
            steps=setup.steps,
            callbacks=[report_callback()],
            stall=_stall_for(setup, config["plan"]),
        )
    except Exception as err:  # e.g. a plan the trainer refuses: the trial's result, not a crash
        from service.train.run import classify_failure

        status, reason = classify_failure(err)
        _log(log_path, f"could not build the trainer: {traceback.format_exc()}")
    else:
        started = time.monotonic()
        status, reason = _fit(trainer, setup.timeout_s, log_path)
        _log(log_path, f"run ended after {time.monotonic() - started:.1f} s: {status} {reason}")
    if status == "hang":
        # The Train run is still going and still reporting: a report from here would wait behind its
        # reports. An error ends the trial at once; Tune's stop takes the run's controller with it.
        raise TrialHang(reason)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / OUTCOME_FILE).write_text(json.dumps({"status": status, "reason": reason}))
    ray.tune.report({"trial_status": status, "trial_reason": reason, "done": 1.0})


def _stall_for(setup: TrialSetup, plan_key: str) -> dict[str, float] | None:
    """The worker stall of the test hook when it names this trial's plan (every rank stalls)."""
    if not setup.stall or setup.stall.get("plan") != plan_key:
        return None
    return {"rank": -1.0, "step": float(setup.stall["step"]), "seconds": float(setup.stall["seconds"])}


def _earlier_outcome(run_dir: Path, steps: int) -> tuple[str, str, dict[str, float]] | None:
    """How this trial's Train run ended in an earlier driver, if it did: its outcome file, or a step
    log that reached the last step (the driver may have died between the last step and the file).
    """
    from service.train.run import read_log

    records, _ = read_log(run_dir)
    last = dict(records[-1].get("metrics", {})) if records else {}
    outcome = run_dir / OUTCOME_FILE
    if outcome.is_file():
        data = json.loads(outcome.read_text())
        return str(data["status"]), str(data["reason"]), last
    if records and int(records[-1]["step"]) >= steps:
        return "ok", "", last
    return None
