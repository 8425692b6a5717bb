"""What a search writes to MLflow for plans it never launched: a run a user does not read as a crash."""

from __future__ import annotations

from pathlib import Path

from mlflow.tracking import MlflowClient

from service.search.prune import prune_space
from service.search.recording import PRUNED_RUN_STATUS, parent_key, record_pruned
from service.search.space import space_from_dict
from service.spec import TrackingSpec, load_experiment
from service.tracking import resolve, tracker_for

REPO = Path(__file__).resolve().parents[2]


def test_pruned_plans_are_finished_runs_tagged_pruned_with_their_reason(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment = load_experiment(REPO / "experiments" / "tiny-cpu.yaml")
    space = space_from_dict(
        {"name": "p", "params": {"zero_stage": [1], "tp": [1, 4], "micro_batch": [2, 8192]}}
    )
    pruned = prune_space(experiment, space).pruned
    assert {p.kind for p in pruned} == {"invalid", "predicted_oom"}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    target = resolve(TrackingSpec(uri=uri, experiment_name="rec", buffer_dir=str(tmp_path / "pending")), "x")
    tracker = tracker_for(target)
    tracker.start_run(parent_key("s1"), "search s1")
    record_pruned(target, "s1", pruned)
    tracker.end_run(parent_key("s1"))

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("rec").experiment_id])
    children = [r for r in runs if r.data.tags.get("trial_status") == "pruned"]
    assert len(children) == len(pruned)
    assert PRUNED_RUN_STATUS == "FINISHED"
    assert {r.info.status for r in children} == {"FINISHED"}  # never FAILED: nothing crashed
    for run in children:
        assert run.data.tags["prune_kind"] in ("invalid", "predicted_oom")
        assert run.data.tags["mlflow.note.content"].startswith("Not launched")
        assert run.data.tags["trial_reason"] in run.data.tags["mlflow.note.content"]
    oom = next(r for r in children if r.data.tags["prune_kind"] == "predicted_oom")
    assert "predicted not to fit" in oom.data.tags["trial_reason"]
    assert oom.data.metrics["predicted_peak_memory_bytes_per_rank"] > 2**30


def test_a_trial_that_ran_on_cpu_for_want_of_cuda_is_tagged_so(tmp_path: Path, monkeypatch) -> None:
    from types import SimpleNamespace

    from service.search.recording import TrialRecorder, trial_key

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment = load_experiment(REPO / "experiments" / "tiny-cpu.yaml")
    space = space_from_dict({"name": "p", "params": {"zero_stage": [1], "tp": [1], "micro_batch": [2]}})
    candidates = prune_space(experiment, space).candidates
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    target = resolve(TrackingSpec(uri=uri, experiment_name="rec", buffer_dir=str(tmp_path / "pending")), "x")
    tracker = tracker_for(target)
    tracker.start_run(parent_key("s1"), "search s1")
    recorder = TrialRecorder(target, "s1", candidates, experiment, str(tmp_path / "runs"), steps=2)
    trial = SimpleNamespace(trial_id="t1", config={"plan": candidates[0].key}, local_path=str(tmp_path))
    fallback = "GPU resource without a CUDA device: ran on CPU/gloo"
    recorder.on_trial_start(0, [], trial)
    recorder.on_trial_result(0, [], trial, {"step": 2, "tokens_per_s": 900.0, "device_fallback": fallback})
    recorder.on_trial_result(0, [], trial, {"trial_status": "ok", "trial_reason": "", "done": 1.0})
    recorder.on_trial_complete(0, [], trial)

    run = MlflowClient(uri).get_run(tracker.run_id(trial_key("s1", "t1")))
    assert run.data.tags["trial_status"] == "ok" and run.data.tags["device_fallback"] == fallback
    assert run.data.metrics["final_measured_tokens_per_s"] == 900.0
    # a trial ASHA stopped keeps its last numbers apart from the finished trials' `final_` ones
    stopped = SimpleNamespace(trial_id="t2", config={"plan": candidates[0].key}, local_path=str(tmp_path))
    recorder.on_trial_start(0, [], stopped)
    recorder.on_trial_result(0, [], stopped, {"step": 1, "tokens_per_s": 1500.0})
    recorder.on_trial_complete(0, [], stopped)
    run = MlflowClient(uri).get_run(tracker.run_id(trial_key("s1", "t2")))
    assert run.data.tags["trial_status"] == "stopped_early" and run.info.status == "KILLED"
    assert run.data.metrics["last_measured_tokens_per_s"] == 1500.0
    assert "final_measured_tokens_per_s" not in run.data.metrics
