"""A real search on a local Ray cluster (CPU): trials run real DeepSpeed proxies, a pruned plan is never
launched, an OOM trial is recorded infeasible and the search goes on, and MLflow holds a parent run
with one child run per trial (params, per-step metrics, status, artifacts) and the pruned plans.
(The shared search, tests/search/conftest.py::tiny_search, also has an unschedulable trial:
tests/search/test_unschedulable_trial.py checks it.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow


def _runs(run) -> tuple[MlflowClient, list]:
    client = MlflowClient(run.uri)
    exp = client.get_experiment_by_name("tiny-search")
    return client, client.search_runs([exp.experiment_id], max_results=100)


def test_trials_ran_in_predicted_order_oom_is_infeasible_and_the_search_went_on(tiny_search) -> None:
    result = tiny_search.result
    assert [t.plan.micro_batch for t in result.trials] == [1024, 4, 2]  # the model ranks mb 1024 first
    oom, stuck, ok = result.trials
    assert stuck.key == tiny_search.stuck_key and stuck.status == "unschedulable"
    assert oom.status == "oom" and "allocate memory" in oom.reason
    assert not oom.measured and oom.predicted["tokens_per_s"] > 0 and oom.predicted["fits"] == 1.0
    assert ok.status == "ok" and ok.steps == 4
    assert ok.measured["tokens_per_s"] > 0 and ok.measured["model_state_bytes_per_rank"] > 0
    assert ok.measured["tokens_per_s"] == pytest.approx(ok.measured["samples_per_s"] * 64)
    assert ok.predicted["tokens_per_s"] > 0
    assert result.best is not None and result.best.trial_id == ok.trial_id
    assert result.num_errors == 1 and result.num_unschedulable == 1  # never placed: not an error
    assert result.stopped_reason == "all 3 planned trials ran"


def test_pruned_plans_are_recorded_and_never_launched(tiny_search) -> None:
    result = tiny_search.result
    kinds = sorted(p.kind for p in result.pruned)
    assert kinds == ["invalid", "invalid", "invalid", "invalid", "predicted_oom"]
    pruned_labels = {p.label for p in result.pruned}
    assert any("mb8192" in label for label in pruned_labels)
    search_dir = Path(result.path)
    launched = {
        json.loads((d / "params.json").read_text())["plan"]
        for d in search_dir.iterdir()
        if (d / "params.json").is_file()
    }
    assert launched == {t.key for t in result.trials}
    assert not launched & pruned_labels
    runs = sorted(p.name for p in (search_dir / "proxy_runs").iterdir())
    assert runs == sorted(f"trial-{t.trial_id}" for t in result.trials)  # no Train run for a pruned plan
    # Tune's CSV and JSON loggers (what the trials' records are read back from), not its TensorBoard one
    for t in result.trials:
        assert (Path(t.path) / "progress.csv").is_file() and (Path(t.path) / "result.json").is_file()
    assert not list(search_dir.rglob("events.out.tfevents*"))


def test_mlflow_parent_and_child_runs(tiny_search) -> None:
    result = tiny_search.result
    client, runs = _runs(tiny_search)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.run_id == result.mlflow_run_id and parent.info.status == "FINISHED"
    assert parent.data.params["algorithm"] == "grid" and parent.data.params["space"] == "oom-and-pruned"
    assert parent.data.params["num_pruned"] == "5" and parent.data.params["num_candidates"] == "3"
    assert len(parent.data.tags["git_commit"]) >= 7
    assert parent.data.tags["selected_plan"] == result.best.key
    assert parent.data.params["selected.micro_batch"] == "2"
    assert parent.data.metrics["best_tokens_per_s"] == pytest.approx(result.best.measured["tokens_per_s"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {
        "experiment.yaml",
        "search_space.yaml",
        "pruned.json",
        "trials.csv",
        "result.json",
        "plots",
    } <= artifacts
    plots = {Path(a.path).name for a in client.list_artifacts(parent.info.run_id, "plots")}
    assert {"tokens_per_s_measured_vs_predicted.png", "tokens_per_s_per_plan.png"} <= plots

    children = {
        r.data.tags.get("trial_id"): r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    for trial in result.trials:
        child = children[trial.trial_id]
        if trial.status == "unschedulable":
            continue  # tests/search/test_unschedulable_trial.py checks its run
        assert child.info.run_id == trial.mlflow_run_id
        assert child.data.params["plan.micro_batch"] == str(trial.plan.micro_batch)
        assert child.data.params["plan.zero_stage"] == "1" and child.data.params["plan.dp"] == "2"
        assert child.data.tags["trial_status"] == trial.status
        assert child.data.metrics["predicted_tokens_per_s"] == pytest.approx(trial.predicted["tokens_per_s"])
        names = {a.path for a in client.list_artifacts(child.info.run_id)}
        assert {"ds_config.json", "logs"} <= names
        logs = {a.path for a in client.list_artifacts(child.info.run_id, "logs")}
        assert "logs/trial.log" in logs
    ok = children[result.best.trial_id]
    assert ok.info.status == "FINISHED"
    history = client.get_metric_history(ok.info.run_id, "measured_tokens_per_s")
    assert [m.step for m in history] == [1, 2, 3, 4]  # one point per step
    assert history[-1].value == pytest.approx(result.best.measured["tokens_per_s"])
    assert ok.data.metrics["final_measured_tokens_per_s"] == pytest.approx(
        result.best.measured["tokens_per_s"]
    )
    ds = json.loads(
        Path(
            client.download_artifacts(ok.info.run_id, "ds_config.json", str(tiny_search.tmp / "dl"))
        ).read_text()
    )
    assert ds["zero_optimization"]["stage"] == 1 and ds["train_micro_batch_size_per_gpu"] == 2
    oom = next(c for c in children.values() if c.data.tags["trial_status"] == "oom")
    assert oom.info.status == "FAILED" and "allocate memory" in oom.data.tags["trial_reason"]

    pruned = [r for r in runs if r.data.tags.get("trial_status") == "pruned"]
    assert len(pruned) == 5 and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in pruned)
    assert {r.info.status for r in pruned} == {"FINISHED"}  # not a crash: never launched
    oom_pruned = next(r for r in pruned if r.data.tags["prune_kind"] == "predicted_oom")
    assert "predicted not to fit" in oom_pruned.data.tags["trial_reason"]
    assert oom_pruned.data.params["plan.micro_batch"] == "8192"


def test_result_table_and_json(tiny_search) -> None:
    result = tiny_search.result
    df = result.get_dataframe()
    assert list(df["status"]) == ["oom", "unschedulable", "ok"] and "measured_tokens_per_s" in df.columns
    assert result.get_best_result("tokens_per_s", "max") is result.best
    assert [t.trial_id for t in result.ranking] == [result.best.trial_id]  # the oom trial is not ranked
    data = json.loads(json.dumps(result.to_dict()))
    assert data["best"]["plan"]["micro_batch"] == 2 and data["mlflow_run_id"] == result.mlflow_run_id
    assert [t["status"] for t in data["trials"]] == ["oom", "unschedulable", "ok"]
    assert len(data["pruned"]) == 5
    assert data["tracking"]["online"] is True and data["tracking"]["pending_records"] == 0
