"""The per-trial driver: one Tune trial builds the proxy `TorchTrainer` for its plan and runs it.

Workers report every step through `ray.train.report`; `TuneReportCallback` forwards each report to
this trial, so Tune (ASHA, the searcher, the MLflow callback) sees every step (the worker's `done`
flag arrives as `last_step`: see `report_callback`). The Train run is named
after the trial id, so when a killed search is restored and Tune restarts this trial, the
`TorchTrainer` finds its own run and resumes from the latest checkpoint.

However the run ends, the trial's last report says how: `trial_status` (ok, oom, failed, invalid,
unschedulable) and `trial_reason`; a failing plan is a result of the search, not an error of it. A run
still going after the trial timeout is the one exception: the trial raises `TrialHang` (a report would
queue behind the run's own), and the search records it as `hang`.

Two clocks, both kept here in the trial's driver (which asks Tune for 0.01 CPU, so it starts as soon as
Tune submits the trial):
- pending: from the trial's start until the placement group of its workers is created (all their
  resources reserved). A Train worker-group callback logs `workers_requested` with the controller's
  actor id in the run's JSONL log, and the trial watches the GCS for that controller's group. Ray Train
  itself waits for the group forever (it retries its 60 s start timeout without limit), e.g. on a
  cluster whose autoscaler cannot get the nodes; past `pending_timeout_s` the trial ends
  `unschedulable` with what it asked for, and the search goes on.
- running: from the placement until the run ends; past `timeout_s` the trial is a `hang`.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan

TRIAL_LOG = "trial.log"
OUTCOME_FILE = "outcome.json"
LAST_STEP = "last_step"  # the worker's `done` flag, renamed on its way to Tune (see report_callback)
REQUESTED_EVENT = "workers_requested"  # in the run's JSONL log (service.train.worker.LOG_FILE)
STARTED_EVENT = "workers_started"
UNSCHEDULABLE_EVENT = "unschedulable"
_POLL_S = 0.2


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one search shares (sent once to the object store by `tune.with_parameters`)."""

    experiment: ExperimentSpec
    plans: dict[str, dict[str, Any]]  # key -> Plan fields
    runs_path: str  # storage_path of the TorchTrainer runs
    steps: int | None
    timeout_s: float
    pending_timeout_s: float = 600.0
    # test hook: {"plan": key or "*", "step", "seconds"} (see tuning.STALL_ENV)
    stall: dict[str, Any] | None = None
    # test hook: {"plan": key, "resources": {name: amount}} added to each worker (see tuning.RESOURCES_ENV)
    extra_resources: dict[str, Any] | None = None


class TrialHang(RuntimeError):
    """A trial whose run did not end within the search's trial timeout; its message starts `hang:`."""


def train_run_name(trial_id: str) -> str:
    return f"trial-{trial_id}"


# How long a Train report may wait for the Tune trial to take it (a trial Tune stops takes no more).
_TAKEN_TIMEOUT_S = 60.0


def wait_until_taken(queue: Any, timeout_s: float = _TAKEN_TIMEOUT_S, poll_s: float = 0.01) -> bool:
    """Waits until `queue` (a `ray.util.queue.Queue`) is empty; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not queue.empty():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def report_callback() -> Any:
    """`TuneReportCallback` that renames the worker's `done` flag to `last_step`, and returns only once
    the Tune trial has taken the report.

    Tune ends a trial on a report with `done` set, killing the `TorchTrainer` while it shuts down. So
    the trial ends when `fit()` returns, and this function reports how it went.

    Why wait: Tune's function trainable (ray/train/_internal/session.py, Ray 2.60) moves a Train report
    from this callback's one-slot actor queue into its own one-slot result queue on its main thread
    (`_get_result_from_queues` → `report`). A report still in the actor queue when `fit()` returns races
    the trial's own final report: if the final report fills the result queue first, the main thread
    blocks putting the Train report behind it and the trial thread blocks behind that, forever (seen:
    a `run` whose search stopped after its second trial, both threads in `Queue.put`). Each report here
    waits until the trial has taken it, so none is left when `fit()` returns.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class _ReportToTune(TuneReportCallback):
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            renamed = [{(LAST_STEP if k == "done" else k): v for k, v in m.items()} for m in metrics]
            super().after_report(run_context, renamed, checkpoint)
            wait_until_taken(self._training_actor_item_queue)

    return _ReportToTune()


def _log(path: Path, message: str) -> None:
    with path.open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")


def _append_event(run_dir: Path, record: dict[str, Any]) -> None:
    """One JSON line in the run's log, beside the workers' own records (they are told apart by `event`)."""
    from service.train.worker import LOG_FILE

    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / LOG_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


def _events(run_dir: Path, since: float) -> list[dict[str, Any]]:
    """This attempt's placement events (at or after `since`) from the run's JSONL log."""
    from service.train.worker import LOG_FILE

    path = run_dir / LOG_FILE
    found = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        if REQUESTED_EVENT in line or STARTED_EVENT in line:
            try:
                record = json.loads(line)
            except ValueError:  # a line being written
                continue
            if float(record.get("time", 0.0)) >= since:
                found.append(record)
    return found


def release_workers(run_dir: Path, since: float) -> int:
    """Ends this attempt's Train controllers, then removes their placement groups (their workers die
    with them): a run the trial gives up on (hang, unschedulable) frees its CPUs/GPUs now, not when Tune
    has finished stopping the trial's actor (which can take up to TUNE_FORCE_TRIAL_CLEANUP_S). The
    controller goes first: a group removed while its workers start is a start-up failure, which Ray
    Train retries without limit (FailureConfig.controller_failure_limit = -1), placing a new group."""
    from service.search.stopping import kill_actor, remove_placement_groups_of

    controllers = {str(e["controller"]) for e in _events(run_dir, since) if e.get("event") == REQUESTED_EVENT}
    for controller in controllers:
        # gone already (or not this process's): removing its group below still frees the workers
        with contextlib.suppress(Exception):
            kill_actor(controller)
    return sum(remove_placement_groups_of(c) for c in controllers)


def workers_placed(run_dir: Path, since: float) -> bool:
    """Whether this attempt's workers have their resources: the controller's placement group is
    created (asked of the GCS), or the workers already started."""
    from service.search.stopping import placement_group_created

    events = _events(run_dir, since)
    if any(e.get("event") == STARTED_EVENT for e in events):
        return True
    controllers = {str(e["controller"]) for e in events if e.get("event") == REQUESTED_EVENT}
    return any(placement_group_created(c) for c in controllers)


def _worker_group_callback_base() -> Any:
    # Ray Train V2 runs RunConfig callbacks that are not `UserCallback`s as its own internal callbacks
    # (ray/train/v2/api/data_parallel_trainer.py: "custom workarounds built on top of internal
    # callbacks"); the worker-group one is the only place that sees the workers placed.
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    return WorkerGroupCallback


def placement_callback(run_dir: Path, extra_resources: dict[str, float] | None = None) -> Any:
    """A Train worker-group callback (it runs in the Train controller, on the trial driver's node) that
    logs `workers_requested` (with the controller's actor id, whose placement group the trial watches)
    and `workers_started`; `extra_resources` (test hook) are added to each worker's request before
    its placement group is made."""

    class PlacementEvents(_worker_group_callback_base()):  # type: ignore[misc]
        def before_worker_group_start(self, worker_group_context: Any) -> None:
            import ray

            if extra_resources:
                worker_group_context.resources_per_worker.update(extra_resources)
            _append_event(
                run_dir,
                {
                    "event": REQUESTED_EVENT,
                    "time": time.time(),
                    "controller": ray.get_runtime_context().get_actor_id(),
                    "num_workers": worker_group_context.num_workers,
                    "resources_per_worker": dict(worker_group_context.resources_per_worker),
                },
            )

        def after_worker_group_start(self, worker_group: Any) -> None:
            _append_event(run_dir, {"event": STARTED_EVENT, "time": time.time()})

    return PlacementEvents()


def unschedulable_reason(trainer: Any, pending_timeout_s: float, extra: dict[str, float] | None) -> str:
    scaling = trainer.scaling_config
    per_worker = dict(scaling.resources_per_worker or {})
    if scaling.use_gpu:
        per_worker.setdefault("GPU", 1.0)
    per_worker.update(extra or {})
    return (
        f"unschedulable: {scaling.num_workers} workers of {per_worker} each were not placed within "
        f"{pending_timeout_s:g} s"
    )


def _give_up(run_dir: Path | None, started: float, log_path: Path) -> None:
    if run_dir is None:
        return
    try:
        released = release_workers(run_dir, started)
    except Exception as err:  # the sweeper removes them once the trial's actor is gone
        _log(log_path, f"could not release the run's workers: {type(err).__name__}: {err}")
    else:
        _log(log_path, f"released {released} placement group(s) of the abandoned run")


def _fit(
    trainer: Any,
    timeout_s: float,
    log_path: Path,
    *,
    pending_timeout_s: float = math.inf,
    run_dir: Path | None = None,
    extra: dict[str, float] | None = None,
    clock: Callable[[], float] = time.time,
    wait: Callable[[threading.Thread], None] = lambda thread: thread.join(_POLL_S),
) -> tuple[str, str]:
    """Runs `trainer.fit()`; (status, reason). Workers not placed within `pending_timeout_s` of the
    start (see `workers_placed`; without `run_dir`, placed at once): unschedulable; a run still going
    `timeout_s` after its workers were placed: a hang. `clock` (wall-clock seconds, as the run's event
    times) and `wait` (one poll of the running fit) are the real ones but for tests.

    A run left going is left to die with this trial's process: Tune ends the trial actor once this
    function returns, and the Train controller and its workers (or its pending placement group, which
    `PlacementGroupSweeper` removes) go with the actor that owns them.
    """
    from service.train.proxy_trial import classify_failure

    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            trainer.fit()
        except BaseException as err:
            outcome["error"] = err
            outcome["trace"] = traceback.format_exc()

    started = clock()
    thread = threading.Thread(target=target, name="proxy-fit", daemon=True)
    thread.start()
    placed: float | None = started if run_dir is None else None
    while thread.is_alive():
        wait(thread)
        now = clock()
        if placed is None and run_dir is not None and workers_placed(run_dir, started):
            placed = now
        if placed is None and now - started > pending_timeout_s:
            _give_up(run_dir, started, log_path)
            return "unschedulable", unschedulable_reason(trainer, pending_timeout_s, extra)
        if placed is not None and now - placed > timeout_s and thread.is_alive():
            _give_up(run_dir, started, log_path)
            return "hang", f"hang: the trial did not finish within {timeout_s:g} s"
    if "error" in outcome:
        _log(log_path, f"the run raised:\n{outcome['trace']}")
        if "InsufficientClusterResourcesError" in outcome["trace"]:  # Ray Train's own up-front check
            lines = [ln.strip() for ln in str(outcome["error"]).splitlines() if "requires" in ln]
            return "unschedulable", "unschedulable: " + (lines[0] if lines else "the cluster is too small")
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
    extra = _extra_resources_for(setup, config["plan"])
    try:
        trainer = build_trainer(
            setup.experiment,
            plan,
            run_name=train_run_name(trial_id),
            storage_path=setup.runs_path,
            steps=setup.steps,
            callbacks=[report_callback(), placement_callback(run_dir, extra)],
            stall=_stall_for(setup, config["plan"]),
        )
    except Exception as err:  # e.g. a plan the trainer refuses: the trial's result, not a crash
        from service.train.proxy_trial import classify_failure

        status, reason = classify_failure(err)
        _log(log_path, f"could not build the trainer: {traceback.format_exc()}")
    else:
        started = time.monotonic()
        status, reason = _fit(
            trainer,
            setup.timeout_s,
            log_path,
            pending_timeout_s=setup.pending_timeout_s,
            run_dir=run_dir,
            extra=extra,
        )
        _log(log_path, f"run ended after {time.monotonic() - started:.1f} s: {status} {reason}")
    if status == "hang":
        # The Train run is still going and still reporting: a report from here would wait behind its
        # reports. An error ends the trial at once; Tune's stop takes the run's controller with it.
        raise TrialHang(reason)
    run_dir.mkdir(parents=True, exist_ok=True)
    if status == UNSCHEDULABLE_EVENT:  # no worker ever ran: the run's log says why it is empty
        _append_event(run_dir, {"event": UNSCHEDULABLE_EVENT, "time": time.time(), "reason": reason})
    (run_dir / OUTCOME_FILE).write_text(json.dumps({"status": status, "reason": reason}))
    ray.tune.report({"trial_status": status, "trial_reason": reason, "done": 1.0})


def _stall_for(setup: TrialSetup, plan_key: str) -> dict[str, float] | None:
    """The worker stall of the test hook when it names this trial's plan, or every plan ("*"); every
    rank stalls."""
    if not setup.stall or setup.stall.get("plan") not in (plan_key, "*"):
        return None
    return {"rank": -1.0, "step": float(setup.stall["step"]), "seconds": float(setup.stall["seconds"])}


def _extra_resources_for(setup: TrialSetup, plan_key: str) -> dict[str, float] | None:
    """The extra worker resources of the test hook when it names this trial's plan."""
    if not setup.extra_resources or setup.extra_resources.get("plan") != plan_key:
        return None
    return {str(k): float(v) for k, v in setup.extra_resources["resources"].items()}


def _earlier_outcome(run_dir: Path, steps: int) -> tuple[str, str, dict[str, float]] | None:
    """How this trial's Train run ended in an earlier driver, if it did: its outcome file, or a step
    log that reached the last step (the driver may have died between the last step and the file).
    """
    from service.train.proxy_trial import read_log

    records, _ = read_log(run_dir)
    last = dict(records[-1].get("metrics", {})) if records else {}
    outcome = run_dir / OUTCOME_FILE
    if outcome.is_file():
        data = json.loads(outcome.read_text())
        return str(data["status"]), str(data["reason"]), last
    if records and int(records[-1]["step"]) >= steps:
        return "ok", "", last
    return None
