"""What a search writes to MLflow, through the narrow `Tracker` interface.

- parent run per search: experiment spec and search space (artifacts and params), git commit,
  counts, and at the end the selected plan, the trial table, the plots;
- child run per trial (`TrialRecorder`, a Tune callback in the driver): plan fields as params,
  predicted metrics, measured and predicted metrics at every step, final metrics, status and reason,
  the DeepSpeed config and the trial's logs as artifacts;
- child run per pruned plan (up to `MAX_PRUNED_RUNS`; all of them in `pruned.json` on the parent).

Run keys are `search:<id>`, `trial:<id>:<trial id>`, `pruned:<id>:<plan>`: stable across a driver
restart, so a restored search continues the same runs.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from ray.tune import Callback

from service.search.prune import Candidate, PrunedPlan
from service.search.result import SearchResult, fallback_of, trial_outcome
from service.search.trial import TRIAL_LOG, train_run_name
from service.spec.experiment import ExperimentSpec
from service.spec.record import PREDICTED, Metrics, Observation
from service.tracking.tracker import tracker_for
from service.tracking.uri import TrackingTarget, repo_root

MAX_PRUNED_RUNS = 200
# MLflow run state per trial status; any other status (oom, failed, invalid, hang) is FAILED. An
# unschedulable trial never ran: the search stopped waiting for it, as it stops an ASHA trial (KILLED),
# and its `trial_status` tag says which; FAILED would read as a crash of the plan.
_STATUS_TO_RUN = {"ok": "FINISHED", "stopped_early": "KILLED", "unschedulable": "KILLED"}
_STATUS_TO_RUN["interrupted"] = "KILLED"  # the search's driver was stopped while the trial ran


def parent_key(search_id: str) -> str:
    return f"search:{search_id}"


def trial_key(search_id: str, trial_id: str) -> str:
    return f"trial:{search_id}:{trial_id}"


def git_commit() -> str:
    """HEAD of the checkout, with `-dirty` when files differ from it; `unknown` outside git."""
    try:
        run = dict(cwd=repo_root(), capture_output=True, text=True, timeout=10)
        head = subprocess.run(["git", "rev-parse", "HEAD"], check=True, **run).stdout.strip()  # type: ignore[call-overload]
        dirty = subprocess.run(["git", "status", "--porcelain"], check=True, **run).stdout.strip()  # type: ignore[call-overload]
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _plan_params(plan_fields: dict[str, Any]) -> dict[str, Any]:
    return {f"plan.{k}": v for k, v in plan_fields.items()}


def start_search(
    target: TrackingTarget, search_id: str, info: dict[str, Any], documents: dict[str, Any]
) -> None:
    """Opens (or, on restore, reopens) the parent run; `documents` are logged as YAML/JSON artifacts."""
    tracker = tracker_for(target)
    key = parent_key(search_id)
    tracker.start_run(
        key, info.get("run_name", search_id), tags={"search_id": search_id, "git_commit": git_commit()}
    )
    tracker.log_batch(key, params=info, tags={"search_status": "running"})
    for name, doc in documents.items():
        text = yaml.safe_dump(doc, sort_keys=False) if name.endswith(".yaml") else json.dumps(doc, indent=2)
        tracker.log_text(key, text, name)


# MLflow run state of a pruned plan. A pruned plan was never launched: its run records a decision (the
# model's prediction and the rule or constraint that excluded it), and that record is complete. MLflow
# reads FAILED as a crash and KILLED as a run stopped while it ran (which is what an ASHA-stopped
# trial is, see `_STATUS_TO_RUN`), so neither fits: FINISHED, with `trial_status=pruned` saying what
# it is (filter `tags.trial_status = 'ok'` for measured plans) and the reason as the run's description.
PRUNED_RUN_STATUS = "FINISHED"


def record_pruned(target: TrackingTarget, search_id: str, pruned: list[PrunedPlan]) -> None:
    """One child run per pruned plan (never launched), with its reason; state `PRUNED_RUN_STATUS`.

    Past `MAX_PRUNED_RUNS` the most telling ones get runs (predicted not to fit, then constraints, then
    invalid layouts); `pruned.json` on the parent run lists them all.
    """
    tracker = tracker_for(target)
    order = {"predicted_oom": 0, "constraint": 1, "invalid": 2}
    for p in sorted(pruned, key=lambda p: order[p.kind])[:MAX_PRUNED_RUNS]:
        key = f"pruned:{search_id}:{p.label}"
        tracker.start_run(
            key,
            f"pruned {p.label}",
            parent_key=parent_key(search_id),
            tags={
                "trial_status": "pruned",
                "prune_kind": p.kind,
                "trial_reason": p.reason,
                "mlflow.note.content": f"Not launched ({p.kind}): {p.reason}",
            },
        )
        fields = p.plan.model_dump() if p.plan is not None else p.point
        tracker.log_batch(key, params=_plan_params(fields), metrics=p.predicted.prefixed(PREDICTED))
        tracker.end_run(key, PRUNED_RUN_STATUS)


def finish_search(target: TrackingTarget, search_id: str, result: SearchResult) -> None:
    """Closes the parent run: counts, the selected plan, the trial table and the plots."""
    from service.tracking.plots import search_plots

    tracker = tracker_for(target)
    key = parent_key(search_id)
    best = result.best
    metrics: dict[str, float] = {
        "num_trials": len(result.trials),
        "num_ok": sum(t.status == "ok" for t in result.trials),
        "num_infeasible": result.num_errors,
        "num_unschedulable": result.num_unschedulable,
        "num_pruned": len(result.pruned),
    }
    status = "interrupted" if result.interrupted else "finished"
    tags = {"search_status": status, "stopped_reason": result.stopped_reason or "all planned trials ran"}
    for t in result.trials:  # Tune stopped them without a trial callback: their runs would stay RUNNING
        if t.status == "interrupted":
            child = trial_key(search_id, t.trial_id)
            tracker.log_batch(child, tags={"trial_status": t.status, "trial_reason": t.reason[:4000]})
            tracker.end_run(child, "KILLED")
    if best is not None:
        metrics[f"best_{result.metric}"] = best.measured[result.metric]
        tags.update(selected_plan=best.key, selected_trial=best.trial_id)
        tracker.log_batch(key, params={f"selected.{k}": v for k, v in best.plan.model_dump().items()})
    tracker.log_batch(key, metrics=metrics, tags=tags)
    tracker.log_text(key, json.dumps(result.to_dict(), indent=2, default=str), "result.json")
    tracker.log_text(key, result.get_dataframe().to_csv(index=False), "trials.csv")
    rows = [
        (
            t.key if t.status == "ok" else f"{t.key} ({t.status})",
            Observation(measured=t.measured, predicted=t.predicted),
        )
        for t in result.trials
    ]
    with tempfile.TemporaryDirectory(prefix="search-plots-") as tmp:
        for png in search_plots(rows, Path(tmp)):
            tracker.log_artifact(key, png, "plots")
    tracker.end_run(key, "KILLED" if result.interrupted else "FINISHED")


class TrialRecorder(Callback):
    """Tune callback (driver side) writing one child run per trial. Picklable: Tune saves it with the
    experiment, and a restored search gets it back with the same keys."""

    def __init__(
        self,
        target: TrackingTarget,
        search_id: str,
        candidates: list[Candidate],
        experiment: ExperimentSpec,
        runs_path: str,
        steps: int,
    ):
        self.target, self.search_id, self.experiment = target, search_id, experiment
        self.runs_path, self.steps = runs_path, steps
        self.plans = {c.key: c.plan.model_dump() for c in candidates}
        self.predicted: dict[str, Metrics] = {c.key: c.predicted for c in candidates}
        self._rows: dict[str, list[dict[str, Any]]] = {}

    def _start(self, trial: Any) -> None:
        tracker = tracker_for(self.target)
        plan_key = trial.config["plan"]
        key = trial_key(self.search_id, trial.trial_id)
        tracker.start_run(
            key,
            f"{plan_key} [{trial.trial_id}]",
            parent_key=parent_key(self.search_id),
            tags={"trial_id": trial.trial_id, "plan": plan_key, "trial_status": "running"},
        )
        tracker.log_batch(
            key,
            params={**_plan_params(self.plans[plan_key]), "plan_key": plan_key},
            metrics=self.predicted.get(plan_key, Metrics()).prefixed(PREDICTED),
            step=0,
        )

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._start(trial)

    def on_trial_restore(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._start(trial)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        rows = self._rows.setdefault(trial.trial_id, [])
        rows[:] = [*rows[-1:], dict(result)]  # the last step and the final status row are enough
        if "step" in result and "trial_status" not in result:
            observed = Observation.from_report(result)  # a worker's report, as Tune hands it over
            tracker_for(self.target).log_metrics(
                trial_key(self.search_id, trial.trial_id), observed.flat(), int(result["step"])
            )

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._end(trial, None)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        error_file = Path(trial.local_path or "") / "error.txt"
        text = error_file.read_text() if error_file.is_file() else "the trial errored"
        self._end(trial, RuntimeError(text.strip().splitlines()[-1] if text.strip() else text))

    def _end(self, trial: Any, error: BaseException | None) -> None:
        tracker = tracker_for(self.target)
        key = trial_key(self.search_id, trial.trial_id)
        plan_key = trial.config["plan"]
        status, reason, step = trial_outcome(self._rows.get(trial.trial_id, []), error, self.steps)
        last: dict[str, Any] = next(
            (r for r in reversed(self._rows.get(trial.trial_id, [])) if "step" in r), {}
        )
        observed = Observation.from_report(last)
        if not observed.predicted:
            observed = observed.model_copy(update={"predicted": self.predicted.get(plan_key, Metrics())})
        # `final_` only for a trial that ran every step: a stopped one's numbers are its last rung's, on
        # fewer steps, and must not sort beside the finished trials' in the MLflow UI.
        final = observed.flat(prefix="final_" if status == "ok" else "last_")
        tags = {"trial_status": status, "trial_reason": reason[:4000]}
        if fallback_of(last):  # CPU numbers for a GPU plan: say so where the run is read
            tags["device_fallback"] = fallback_of(last)
        if status == "unschedulable":
            tags["mlflow.note.content"] = f"Never ran: {reason}"
        tracker.log_batch(key, metrics=final, tags=tags, step=step)
        self._log_artifacts(key, trial, plan_key)
        tracker.end_run(key, _STATUS_TO_RUN.get(status, "FAILED"))

    def _log_artifacts(self, key: str, trial: Any, plan_key: str) -> None:
        from service.spec.plan import Plan
        from service.train.ds_config import deepspeed_config
        from service.train.proxy_scale import proxy_model, proxy_plan

        tracker = tracker_for(self.target)
        plan = proxy_plan(self.experiment, Plan.model_validate(self.plans[plan_key]))
        ds = deepspeed_config(plan, self.experiment.proxy, proxy_model(self.experiment))
        tracker.log_text(key, json.dumps(ds, indent=2, default=str), "ds_config.json")
        trial_dir = Path(trial.local_path or "")
        for name in (TRIAL_LOG, "stdout", "stderr", "error.txt"):
            if (trial_dir / name).is_file():
                tracker.log_artifact(key, trial_dir / name, "logs")
        run_dir = Path(self.runs_path) / train_run_name(trial.trial_id)
        for path in sorted(run_dir.glob("**/*.jsonl")) if run_dir.is_dir() else []:
            tracker.log_artifact(key, path, "logs/workers")
