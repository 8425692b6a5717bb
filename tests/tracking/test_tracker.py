"""Tracker against real MLflow stores: sqlite round trip, a run reopened by key, a store that is down
(records kept locally, in order, artifacts copied) and comes back (records written), refused records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from service.cluster.ports import free_port
from service.spec import TrackingSpec
from service.tracking import Tracker, resolve
from service.tracking.server import mlflow_server


def _target(tmp_path: Path, uri: str, name: str = "exp"):
    return resolve(
        TrackingSpec(uri=uri, experiment_name=name, buffer_dir=str(tmp_path / "pending")), "unused"
    )


def _runs(client: MlflowClient, name: str) -> dict[str, object]:
    exp = client.get_experiment_by_name(name)
    return {r.data.tags["service.key"]: r for r in client.search_runs([exp.experiment_id])}


def test_sqlite_parent_child_params_metrics_artifacts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(_target(tmp_path, uri))
    assert tracker.online
    tracker.start_run("search:1", "my search", tags={"git_commit": "abc"})
    tracker.start_run("trial:1:a", "trial a", parent_key="search:1")
    tracker.log_batch("trial:1:a", params={"plan.tp": 2}, metrics={"predicted_tokens_per_s": 900.0}, step=0)
    for step, value in enumerate([100.0, 110.0, 120.0], start=1):
        tracker.log_metrics("trial:1:a", {"measured_tokens_per_s": value, "nan": float("nan")}, step)
    tracker.log_text("trial:1:a", json.dumps({"zero_optimization": {"stage": 1}}), "ds_config.json")
    tracker.end_run("trial:1:a", "FAILED")
    tracker.end_run("search:1")

    client = MlflowClient(uri)
    runs = _runs(client, "exp")
    parent, child = runs["search:1"], runs["trial:1:a"]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id == tracker.run_id("search:1")
    assert child.data.params == {"plan.tp": "2"} and child.info.status == "FAILED"
    history = client.get_metric_history(child.info.run_id, "measured_tokens_per_s")
    assert [(m.step, m.value) for m in history] == [(1, 100.0), (2, 110.0), (3, 120.0)]
    assert "nan" not in child.data.metrics  # NaN is not a measurement
    assert [a.path for a in client.list_artifacts(child.info.run_id)] == ["ds_config.json"]
    # Artifacts live next to the sqlite file, one folder per experiment.
    assert (
        client.get_experiment_by_name("exp").artifact_location == (tmp_path / "mlartifacts" / "exp").as_uri()
    )

    # A restarted driver (new Tracker) finds the run by key instead of creating another.
    again = Tracker(_target(tmp_path, uri))
    again.start_run("trial:1:a", "trial a", parent_key="search:1")
    again.log_metrics("trial:1:a", {"measured_tokens_per_s": 130.0}, 4)
    again.end_run("trial:1:a", "FINISHED")
    runs = _runs(client, "exp")
    assert len(runs) == 2 and runs["trial:1:a"].info.status == "FINISHED"
    assert len(client.get_metric_history(runs["trial:1:a"].info.run_id, "measured_tokens_per_s")) == 4


def test_refused_record_is_reported_not_retried(tmp_path: Path) -> None:
    tracker = Tracker(_target(tmp_path, f"sqlite:///{tmp_path / 'm.db'}"))
    tracker.start_run("r", "r")
    tracker.log_params("r", {"tp": 1})
    tracker.log_params("r", {"tp": 2})  # MLflow params are immutable: the store refuses this one
    assert tracker.online and tracker.pending_count() == 0
    assert len(tracker.rejected) == 1 and "log_batch r" in tracker.rejected[0]


@pytest.mark.slow  # an MLflow server (about 10-30 s to start on 2 cores)
def test_store_down_keeps_records_in_order_and_writes_them_when_back(tmp_path: Path) -> None:
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    target = _target(tmp_path, uri, name="down-then-up")
    tracker = Tracker(target, retry_interval_s=5.0)  # the server takes longer than that to start
    assert not tracker.online and tracker.status()["last_error"]
    artifact = tmp_path / "trial.log"
    artifact.write_text("step 1 ok\n")
    tracker.start_run("search:9", "search 9")
    tracker.start_run("trial:9:x", "trial x", parent_key="search:9", tags={"trial_status": "oom"})
    tracker.log_batch("trial:9:x", params={"plan.micro_batch": 1024}, metrics={"predicted_fits": 1.0})
    tracker.log_metrics("trial:9:x", {"measured_tokens_per_s": 42.0}, step=3)
    tracker.log_artifact("trial:9:x", artifact, "logs")
    artifact.unlink()  # the trial folder may be gone by the time the store is back: a copy was kept
    tracker.end_run("trial:9:x", "FAILED")
    assert tracker.pending_count() == 6 and tracker.run_id("trial:9:x") is None
    assert target.buffer_file.is_file()

    with mlflow_server(
        f"sqlite:///{tmp_path / 'server.db'}", port=port, artifacts_destination=tmp_path / "art"
    ):
        tracker.end_run("search:9")  # the next record finds the store back: backlog first, then this one
        assert tracker.online and tracker.pending_count() == 0 and not target.buffer_file.exists()
        client = MlflowClient(uri)
        runs = _runs(client, "down-then-up")
        parent, child = runs["search:9"], runs["trial:9:x"]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params == {"plan.micro_batch": "1024"} and child.data.tags["trial_status"] == "oom"
        assert child.data.metrics["measured_tokens_per_s"] == 42.0 and child.info.status == "FAILED"
        assert parent.info.status == "FINISHED"
        local = client.download_artifacts(child.info.run_id, "logs/trial.log", str(tmp_path / "dl"))
        assert Path(local).read_text() == "step 1 ok\n"


def test_uri_precedence(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = resolve(TrackingSpec(), "e")
    assert default.uri.startswith("sqlite:///") and default.uri.endswith("/mlflow.db")
    assert default.artifact_location is not None and default.artifact_location.endswith("/mlartifacts")
    assert default.experiment_name == "e"
    spec = TrackingSpec(uri="http://127.0.0.1:5999", experiment_name="x")
    assert resolve(spec, "e").uri == "http://127.0.0.1:5999" and resolve(spec, "e").artifact_location is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/env.db")
    target = resolve(spec, "e")
    assert target.uri == f"sqlite:///{tmp_path}/env.db"
    assert target.artifact_location == (tmp_path / "mlartifacts").as_uri()
    with pytest.raises(Exception, match="extra"):
        TrackingSpec.model_validate({"url": "x"})


def test_records_kept_by_one_process_are_written_by_the_next(tmp_path: Path) -> None:
    """A sqlite store whose folder cannot be created is "down"; once it can, `replay_pending` writes."""
    from service.tracking import replay_pending

    blocker = tmp_path / "store"
    blocker.write_text("a file where the store's folder should be")
    uri = f"sqlite:///{blocker / 'mlflow.db'}"
    spec = TrackingSpec(uri=uri, experiment_name="later", buffer_dir=str(tmp_path / "pending"))
    tracker = Tracker(resolve(spec, "unused"))
    assert not tracker.online
    tracker.start_run("search:7", "search 7")
    tracker.log_metrics("search:7", {"best_tokens_per_s": 77.0})
    tracker.end_run("search:7")
    assert tracker.pending_count() == 3

    blocker.unlink()  # the store can be created now
    status = replay_pending(spec)
    assert status["online"] and status["pending_records"] == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("later").experiment_id])
    assert run.data.metrics["best_tokens_per_s"] == 77.0 and run.info.status == "FINISHED"


def test_an_id_map_naming_runs_the_store_lacks_is_corrected(tmp_path: Path, monkeypatch) -> None:
    """The id map beside the backlog can name runs the store does not have (the store was reset or
    replaced under the same URI): each id is checked, and the run is found by its key or made again,
    instead of every later record being refused ("Run with id=... not found")."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = Tracker(_target(tmp_path, uri))
    first.start_run("search:1", "my search")
    first.end_run("search:1")
    ids = tmp_path / "pending" / first.target.buffer_file.with_suffix(".runs.json").name
    stale = {
        "search:1": "0123456789abcdef0123456789abcdef",
        "trial:1:gone": "fedcba9876543210fedcba9876543210",
    }
    ids.write_text(json.dumps(stale))
    again = Tracker(_target(tmp_path, uri))
    again.start_run("search:1", "my search")
    again.log_batch("search:1", metrics={"num_trials": 3.0})
    again.start_run("trial:1:gone", "a trial", parent_key="search:1")
    again.end_run("trial:1:gone")
    again.end_run("search:1")
    assert again.rejected == [] and again.run_id("search:1") == first.run_id("search:1")
    runs = _runs(MlflowClient(uri), "exp")
    assert runs["search:1"].data.metrics == {"num_trials": 3.0}
    assert runs["trial:1:gone"].info.run_id == again.run_id("trial:1:gone") != stale["trial:1:gone"]
