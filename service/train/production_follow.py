"""The driver's side of a production run (service/train/production.py): it follows rank 0's step log on
the run's storage, logs each step to MLflow and shows one line of progress; the workers never talk to
MLflow themselves.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, TextIO

from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan

ARTIFACT_MAX_BYTES = 1 << 30  # exported weights up to 1 GiB are copied into MLflow's artifact store


def step_numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of one step record."""
    return {k: float(v) for k, v in record.get("metrics", {}).items() if isinstance(v, int | float)}


class StepFollower:
    """Follows rank 0's step log from the driver: MLflow metrics per step, one progress line."""

    def __init__(self, run_dir: Path, total: int, tracker: Any, out: TextIO | None):
        self.run_dir, self.total, self.tracker, self.out = run_dir, total, tracker, out
        self.logged = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="production-follow", daemon=True)

    def __enter__(self) -> StepFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.poll()  # the last steps, written just before fit() returned
        if self.out is not None:
            self.out.write("\n")
            self.out.flush()

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        from service.train.proxy_trial import read_log

        records, restarts = read_log(self.run_dir)
        for record in records[self.logged :]:
            metrics = {"loss": float(record["loss"]), "restarts": float(restarts)}
            numbers = step_numbers(record)
            keys = ("tokens_per_s", "step_time_s", "eval_loss")
            metrics.update({k: numbers[k] for k in keys if k in numbers})
            if self.tracker is not None:
                self.tracker.log_metrics(metrics, step=int(record["step"]))
        shown, self.logged = self.logged, max(self.logged, len(records))
        if self.out is not None and records and self.logged > shown:
            last = records[-1]
            rate = step_numbers(last).get("tokens_per_s")
            speed = f"  {rate:,.0f} tokens/s" if rate else ""
            step, loss = last["step"], float(last["loss"])
            evals = [step_numbers(r)["eval_loss"] for r in records if "eval_loss" in step_numbers(r)]
            held = f"  eval {evals[-1]:.4f}" if evals else ""
            line = f"\rstep {step}/{self.total}  loss {loss:.4f}{held}{speed}  restarts {restarts}   "
            self.out.write(line)
            self.out.flush()


class ProductionMlflowRun:
    """The driver's MLflow run for a production run (params at start, metrics per step)."""

    def __init__(self, experiment: ExperimentSpec, plan: Plan, run_name: str, tags: dict[str, str]):
        import mlflow

        from service.tracking.uri import resolve

        target = resolve(experiment.tracking, experiment.name)
        self.client = mlflow.MlflowClient(tracking_uri=target.uri)
        exp = self.client.get_experiment_by_name(target.experiment_name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            target.experiment_name, artifact_location=target.experiment_location(target.experiment_name)
        )  # fmt: skip
        tags = {"service.kind": "production", **tags}
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        params = {"plan": plan.short(), **{k: str(v) for k, v in plan.model_dump().items()}}
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_model(self, directory: Path) -> None:
        """The exported weights as the run's `hf_model` artifact when small (a tag has their path)."""
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        if size <= ARTIFACT_MAX_BYTES:
            self.client.log_artifacts(self.run_id, str(directory), artifact_path="hf_model")
        self.client.set_tag(self.run_id, "hf_model", str(directory))

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if status == "ok" else "FAILED")
