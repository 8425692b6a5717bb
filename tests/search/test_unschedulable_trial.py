"""A trial whose workers ask for a resource the cluster never has ends `unschedulable` within the
pending timeout, with its reason in the result, the run's JSONL log and MLflow (KILLED, not FAILED),
and the search goes on to a trial that finishes (the shared search on a real local Ray,
tests/search/conftest.py::tiny_search: its micro-batch-4 trial asks for "unobtainium")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.search.conftest import PENDING_S

pytestmark = pytest.mark.slow


def test_a_trial_that_cannot_be_placed_is_unschedulable_and_the_search_goes_on(tiny_search) -> None:
    result = tiny_search.result
    by_key = {t.key: t for t in result.trials}
    stuck, ran = by_key[tiny_search.stuck_key], result.best
    assert ran is not None and ran.status == "ok" and ran.measured["tokens_per_s"] > 0
    assert stuck.status == "unschedulable", stuck.reason
    wanted = "unschedulable: 2 workers of {'CPU': 1, 'unobtainium': 1.0} each were not placed within"
    assert stuck.reason == f"{wanted} {PENDING_S} s"
    assert stuck.steps == 0 and not stuck.measured and stuck.predicted  # the model's numbers are kept
    assert result.num_unschedulable == 1

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

    client = MlflowClient(tiny_search.uri)
    run = client.get_run(stuck.mlflow_run_id)
    assert run.info.status == "KILLED"  # not FAILED: nothing crashed, the search stopped waiting
    assert run.data.tags["trial_status"] == "unschedulable" and run.data.tags["trial_reason"] == stuck.reason
    assert (run.info.end_time - run.info.start_time) / 1000 >= PENDING_S  # it waited the whole timeout
    assert client.get_run(ran.mlflow_run_id).info.status == "FINISHED"
    parent = client.get_run(result.mlflow_run_id)
    assert parent.data.metrics["num_unschedulable"] == 1 and parent.data.metrics["num_ok"] == 1
