"""`Tracker`: the narrow interface the search driver writes MLflow through.

Only the driver writes (workers report to Ray). Runs are named by a caller-chosen `key` (stable
across a driver restart), stored as the tag `service.key`, so a resumed search finds and continues its
runs instead of duplicating them. Every call becomes one operation; if the store cannot take it
(server down, disk unwritable) the operation goes to `PendingRecords` and all later ones follow it
there, in order, until a probe finds the store again and the backlog is written first. So a failure
of the tracking store never loses a result and never stops a search.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from service.tracking.buffer import PendingRecords
from service.tracking.uri import TrackingTarget

log = logging.getLogger(__name__)

KEY_TAG = "service.key"
PARENT_TAG = "mlflow.parentRunId"
# A store that does not answer should cost seconds, not MLflow's default minutes of retries.
_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


class Tracker:
    """Writes runs, params, metrics, tags and artifacts to MLflow, or keeps them locally until it can.

    Example:
        >>> t = Tracker(resolve(TrackingSpec(), "demo"))                  # doctest: +SKIP
        >>> t.start_run("search:1", "my search")                           # doctest: +SKIP
        >>> t.log_metrics("search:1", {"best_tokens_per_s": 1234.0})       # doctest: +SKIP
        >>> t.end_run("search:1")                                          # doctest: +SKIP
    """

    def __init__(self, target: TrackingTarget, retry_interval_s: float = 30.0):
        for name, value in _HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        self.target = target
        self.retry_interval_s = retry_interval_s
        self.pending = PendingRecords(target.buffer_file)
        self._ids_file = target.buffer_file.with_suffix(".runs.json")
        self._run_ids: dict[str, str] = _read_json(self._ids_file)
        self._confirmed: set[str] = set()  # ids of the map this store has answered for
        self._client: Any = None
        self._experiment_ids: dict[str, str] = {}
        self._online = False
        self._last_probe_s = -float("inf")
        self.last_error: str | None = None
        self.rejected: list[str] = []
        self.connect()

    # -- state -----------------------------------------------------------------------------------
    @property
    def online(self) -> bool:
        return self._online

    def pending_count(self) -> int:
        return len(self.pending)

    def run_id(self, key: str) -> str | None:
        """The MLflow run id of `key` (None while its run exists only in the local backlog)."""
        return self._run_ids.get(key)

    def status(self) -> dict[str, Any]:
        """What a user needs to know after a search: where records went and whether any wait."""
        pending = self.pending_count()
        return {
            "uri": self.target.uri,
            "experiment": self.target.experiment_name,
            "online": self._online,
            "pending_records": pending,
            "pending_file": str(self.pending.path) if pending else None,
            "last_error": self.last_error,
            "rejected": list(self.rejected),
        }

    def connect(self) -> bool:
        """Probes the store; when it answers, writes the backlog first. Returns whether it is online."""
        self._last_probe_s = time.monotonic()
        try:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.target.uri)
            self._client.search_experiments(max_results=1)
        except Exception as err:  # any failure to reach or open the store means "offline"
            self._set_offline(err)
            return False
        self._online = True
        self.replay()
        return self._online

    # -- the interface ---------------------------------------------------------------------------
    def start_run(
        self, key: str, run_name: str, parent_key: str | None = None, tags: dict[str, str] | None = None
    ) -> None:
        """Creates the run for `key`, or reopens it when a run with that key exists (resumed search)."""
        self._submit(
            {
                "op": "start_run",
                "key": key,
                "run_name": run_name,
                "parent_key": parent_key,
                "experiment": self.target.experiment_name,
                "tags": {k: str(v) for k, v in (tags or {}).items()},
            }
        )

    def log_batch(
        self,
        key: str,
        params: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        tags: dict[str, Any] | None = None,
        step: int | None = None,
    ) -> None:
        """Params, metrics (at `step`) and tags in one request: the cheap way to fill a run."""
        op: dict[str, Any] = {"op": "log_batch", "key": key, "step": step or 0, "ts": int(time.time() * 1000)}
        op["params"] = {k: str(v) for k, v in (params or {}).items()}
        op["metrics"] = {k: float(v) for k, v in (metrics or {}).items() if _is_finite_number(v)}
        op["tags"] = {k: str(v) for k, v in (tags or {}).items()}
        self._submit(op)

    def log_params(self, key: str, params: dict[str, Any]) -> None:
        self._submit({"op": "log_batch", "key": key, "params": {k: str(v) for k, v in params.items()}})

    def set_tags(self, key: str, tags: dict[str, Any]) -> None:
        self._submit({"op": "log_batch", "key": key, "tags": {k: str(v) for k, v in tags.items()}})

    def log_metrics(self, key: str, metrics: dict[str, float], step: int | None = None) -> None:
        now_ms = int(time.time() * 1000)
        finite = {k: float(v) for k, v in metrics.items() if _is_finite_number(v)}
        if finite:
            self._submit({"op": "log_batch", "key": key, "metrics": finite, "step": step or 0, "ts": now_ms})

    def log_artifact(self, key: str, local_path: str | Path, artifact_path: str | None = None) -> None:
        self._submit(
            {"op": "log_artifact", "key": key, "local_path": str(local_path), "artifact_path": artifact_path}
        )

    def log_text(self, key: str, text: str, artifact_file: str) -> None:
        """Logs `text` as the artifact `artifact_file` (e.g. `configs/ds_config.json`)."""
        folder = Path(tempfile.mkdtemp(prefix="tracker-"))
        path = folder / Path(artifact_file).name
        path.write_text(text)
        parent = str(Path(artifact_file).parent)
        self.log_artifact(key, path, None if parent == "." else parent)

    def end_run(self, key: str, status: str = "FINISHED") -> None:
        """`status` is an MLflow run status: FINISHED, FAILED or KILLED."""
        self._submit({"op": "end_run", "key": key, "status": status})

    def replay(self) -> int:
        """Writes the backlog in order; stops at the first failure and keeps the rest. Returns written."""
        ops = self.pending.load()
        done = 0
        for op in ops:
            try:
                self._apply(op)
            except Exception as err:
                if self._probe():
                    self._reject(op, err)  # the store is up but refuses this record: never retry it
                    done += 1
                    continue
                self._set_offline(err)
                break
            done += 1
        if ops:
            self.pending.keep_only(ops[done:])
            log.info("tracking: wrote %d of %d pending records to %s", done, len(ops), self.target.uri)
        return done

    # -- internals -------------------------------------------------------------------------------
    def _submit(self, op: dict[str, Any]) -> None:
        if not self._online and time.monotonic() - self._last_probe_s >= self.retry_interval_s:
            self.connect()
        if not self._online:
            self.pending.append(op)
            return
        try:
            self._apply(op)
        except Exception as err:
            if self._probe():
                self._reject(op, err)
            else:
                self._set_offline(err)
                self.pending.append(op)

    def _probe(self) -> bool:
        try:
            self._client.search_experiments(max_results=1)
            return True
        except Exception:
            return False

    def _set_offline(self, err: BaseException) -> None:
        if self._online or self.last_error is None:
            log.warning(
                "tracking store %s unreachable (%s); keeping records in %s",
                self.target.uri,
                _one_line(err),
                self.pending.path,
            )
        self._online = False
        self._last_probe_s = time.monotonic()
        self.last_error = _one_line(err)

    def _reject(self, op: dict[str, Any], err: BaseException) -> None:
        message = f"{op.get('op')} {op.get('key')}: {_one_line(err)}"
        log.warning("tracking store refused a record: %s", message)
        self.rejected.append(message)

    def _experiment_id(self, name: str) -> str:
        """The id of MLflow experiment `name`, created (with the artifact root) when missing."""
        if name not in self._experiment_ids:
            exp = self._client.get_experiment_by_name(name)
            if exp is None:
                location = self.target.experiment_location(name)  # one folder per experiment
                # The MLflow UI opens training experiments on their runs table (not the GenAI view).
                tags = {"mlflow.experimentKind": "custom_model_development"}
                exp_id = str(self._client.create_experiment(name, location, tags=tags))
            else:
                if exp.lifecycle_stage == "deleted":
                    self._client.restore_experiment(exp.experiment_id)
                exp_id = str(exp.experiment_id)
            self._experiment_ids[name] = exp_id
        return self._experiment_ids[name]

    def _apply(self, op: dict[str, Any]) -> None:
        kind = op["op"]
        if kind == "start_run":
            self._apply_start(op)
            return
        run_id = self._known_run(op["key"])
        if run_id is None:
            raise KeyError(f"no run was started for key {op['key']!r}")
        if kind == "log_batch":
            self._apply_batch(run_id, op)
        elif kind == "log_artifact":
            self._client.log_artifact(run_id, op["local_path"], op.get("artifact_path"))
        elif kind == "end_run":
            self._client.set_terminated(run_id, op["status"])
        else:
            raise ValueError(f"unknown tracking operation {kind!r}")

    def _apply_start(self, op: dict[str, Any]) -> None:
        key = op["key"]
        run_id = self._known_run(key)
        if run_id is not None:
            self._client.update_run(run_id, status="RUNNING")
        else:
            tags = {**op["tags"], KEY_TAG: key}
            if op.get("parent_key"):
                parent_id = self._known_run(op["parent_key"])
                if parent_id is None:
                    raise KeyError(f"parent run {op['parent_key']!r} does not exist")
                tags[PARENT_TAG] = parent_id
            exp_id = self._experiment_id(op.get("experiment") or self.target.experiment_name)
            run = self._client.create_run(exp_id, run_name=op["run_name"], tags=tags)
            run_id = run.info.run_id
        self._remember(key, run_id)

    def _apply_batch(self, run_id: str, op: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        metrics = [Metric(k, v, op["ts"], op["step"]) for k, v in op.get("metrics", {}).items()]
        params = [Param(k, v) for k, v in op.get("params", {}).items()]
        tags = [RunTag(k, v) for k, v in op.get("tags", {}).items()]
        self._client.log_batch(run_id, metrics=metrics, params=params, tags=tags)

    def _known_run(self, key: str) -> str | None:
        """The run of `key`: the id map's, once the store confirms it has that run (a store reset or
        replaced under the same URI does not: the key is then looked up, or its run made again), else
        the store's run tagged with it."""
        run_id = self._run_ids.get(key)
        if run_id is not None and run_id not in self._confirmed:
            try:
                self._client.get_run(run_id)
                self._confirmed.add(run_id)
            except Exception as err:  # MlflowException RESOURCE_DOES_NOT_EXIST: the store lost it
                if "RESOURCE_DOES_NOT_EXIST" not in str(getattr(err, "error_code", "")) + str(err):
                    raise
                del self._run_ids[key]
                run_id = None
        return run_id or self._find_run(key)

    def _find_run(self, key: str) -> str | None:
        """Looks a run up by its key tag (a resumed driver, or an id map that was lost)."""
        exp_ids = sorted({*self._experiment_ids.values(), self._experiment_id(self.target.experiment_name)})
        runs = self._client.search_runs(exp_ids, filter_string=f"tags.`{KEY_TAG}` = '{key}'", max_results=1)
        if not runs:
            return None
        self._remember(key, runs[0].info.run_id)
        return str(runs[0].info.run_id)

    def _remember(self, key: str, run_id: str) -> None:
        if self._run_ids.get(key) == run_id:
            return
        self._run_ids[key] = run_id
        self._confirmed.add(run_id)
        self._ids_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._ids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._run_ids, indent=0, sort_keys=True))
        tmp.replace(self._ids_file)


_TRACKERS: dict[tuple[str, str, str], Tracker] = {}


def tracker_for(target: TrackingTarget) -> Tracker:
    """One `Tracker` per store in this process, so every writer shares one backlog and one id map."""
    ident = (target.uri, target.experiment_name, str(target.buffer_file))
    if ident not in _TRACKERS:
        _TRACKERS[ident] = Tracker(target)
    return _TRACKERS[ident]


def _read_json(path: Path) -> dict[str, str]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value == value and abs(value) != float("inf")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"
