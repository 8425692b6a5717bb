"""A trial whose workers ask for a resource the cluster never has ends `unschedulable` within the
pending timeout, with its reason in the result, the run's JSONL log and MLflow (KILLED, not FAILED),
and the search goes on to a trial that finishes (real local Ray, CPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from service.search.prune import prune_space
from service.search.space import load_space
from service.search.tuning import RESOURCES_ENV
from service.spec.experiment import load_experiment

pytestmark = pytest.mark.slow

PENDING_S = 20  # the good trial must be placed within it too: its controller alone takes 5-7 s to start


def test_a_trial_that_cannot_be_placed_is_unschedulable_and_the_search_goes_on(
    tmp_path, experiment_file, space_file, monkeypatch
) -> None:
    from service.search import RunConfig, Search, SearchConfig

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    experiment = experiment_file("unschedulable")
    space = space_file("pending-space", {"zero_stage": [0], "micro_batch": [2, 4]}, asha=None)
    first, second = (c.key for c in prune_space(load_experiment(experiment), load_space(space)).candidates)
    # The first plan launched asks for a resource no node has: Ray would keep its placement group
    # pending forever. On 2 cores one trial runs at a time, so the second waits for the first to end.
    monkeypatch.setenv(RESOURCES_ENV, json.dumps({"plan": first, "resources": {"unobtainium": 1}}))
    started = time.monotonic()
    result = Search(
        experiment,
        space,
        config=SearchConfig(pending_timeout_s=PENDING_S, trial_timeout_s=300),
        run_config=RunConfig(storage_path=tmp_path / "searches"),
    ).fit()
    elapsed = time.monotonic() - started

    by_key = {t.key: t for t in result.trials}
    stuck, ran = by_key[first], by_key[second]
    assert (stuck.status, ran.status) == ("unschedulable", "ok"), (stuck.reason, ran.reason)
    wanted = "unschedulable: 2 workers of {'CPU': 1, 'unobtainium': 1.0} each were not placed within"
    assert stuck.reason == f"{wanted} {PENDING_S} s"
    assert stuck.steps == 0 and not stuck.measured and stuck.predicted  # the model's numbers are kept
    assert ran.measured["tokens_per_s"] > 0
    assert result.best is not None and result.best.key == second
    assert result.num_unschedulable == 1 and result.num_errors == 0
    assert elapsed < 600  # did not wait forever (the whole search, workers' start-up included)

    run_dir = Path(result.path) / "proxy_runs" / f"trial-{stuck.trial_id}"
    events = [json.loads(line) for line in (run_dir / "proxy_log.jsonl").read_text().splitlines()]
    # Ray Train asks again once the trial removed its pending group; no worker ever logged a step.
    kinds = [e["event"] for e in events]
    assert kinds[0] == "workers_requested" and set(kinds) == {"workers_requested", "unschedulable"}
    assert events[0]["resources_per_worker"] == {"CPU": 1, "unobtainium": 1.0} and events[0]["controller"]
    assert next(e for e in events if e["event"] == "unschedulable")["reason"] == stuck.reason
    ran_dir = Path(result.path) / "proxy_runs" / f"trial-{ran.trial_id}"
    ran_events = [
        json.loads(line)["event"] for line in (ran_dir / "proxy_log.jsonl").read_text().splitlines()
    ]
    assert ran_events[:2] == ["workers_requested", "workers_started"] and "step" in ran_events

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(stuck.mlflow_run_id)
    assert run.info.status == "KILLED"  # not FAILED: nothing crashed, the search stopped waiting
    assert run.data.tags["trial_status"] == "unschedulable" and run.data.tags["trial_reason"] == stuck.reason
    waited_s = (run.info.end_time - run.info.start_time) / 1000
    assert PENDING_S <= waited_s < PENDING_S + 60, waited_s
    assert client.get_run(ran.mlflow_run_id).info.status == "FINISHED"
    parent = client.get_run(result.mlflow_run_id)
    assert parent.data.metrics["num_unschedulable"] == 1 and parent.data.metrics["num_ok"] == 1
