"""A trial that does not finish within the search's trial timeout is recorded as a hang (infeasible),
its Train run is ended with it, and the search goes on to the next trial (real Ray, CPU)."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow


def test_hung_trials_are_infeasible_and_the_search_goes_on(
    tmp_path, experiment_file, space_file, monkeypatch
) -> None:
    from service.search import RunConfig, Search
    from service.search.tuning import STALL_ENV

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # Every trial's workers sleep before step 2 for longer than the test runs (the test hook), so no
    # trial can finish within its 6 s, however fast the machine: each one "hangs".
    monkeypatch.setenv(STALL_ENV, json.dumps({"plan": "*", "step": 2, "seconds": 900}))
    experiment = experiment_file("hang", steps=4)
    # A pending clock well inside the test's own timeout: workers that are never placed (resources held
    # by a run that was not ended) fail this test as "unschedulable", with the trials' logs, not silently.
    space = space_file(
        "hang-space",
        {"zero_stage": [0], "micro_batch": [2, 4]},
        trial_timeout_s=6,
        pending_timeout_s=240,
        asha=None,
        steps=4,
    )
    result = Search(experiment, space, run_config=RunConfig(storage_path=tmp_path / "searches")).fit()

    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "searches").rglob("trial.log")))
    # the second ran after the first hung
    assert [t.status for t in result.trials] == ["hang", "hang"], logs
    assert all(t.reason == "hang: the trial did not finish within 6 s" for t in result.trials)
    assert result.best is None and result.num_errors == 2
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    for trial in result.trials:
        run = client.get_run(trial.mlflow_run_id)
        assert run.info.status == "FAILED" and run.data.tags["trial_status"] == "hang"
