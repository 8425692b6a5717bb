"""`search --resume PATH --json` on a copy of the shared search's folder (tests/search/conftest.py), in
this process: the restored search reports the trials it had, in the same order and with the same
outcomes, runs none of them again, and MLflow keeps one parent run and one child run per trial.

A search killed mid-trial and continued (the finished trial not run again, the running one resumed
from its checkpoint) goes through the same `Search.restore`: tests/design/test_run_e2e.py kills a
`run` there and restarts it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from service.cli.main import main
from service.search.state import STATE_FILE

pytestmark = pytest.mark.slow


def _copy(tiny_search, tmp_path: Path) -> tuple[Path, str]:
    """The shared search's folder and MLflow store copied under `tmp_path` (the shared ones stay as the
    other tests read them); the copy's state names the copied store."""
    folder = tmp_path / "search" / "tiny-search"
    shutil.copytree(tiny_search.folder, folder)
    shutil.copy(tiny_search.tmp / "mlflow.db", tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    state = json.loads((folder / STATE_FILE).read_text())
    state["tracking"].update(uri=uri, buffer_dir=str(tmp_path / "pending"))
    (folder / STATE_FILE).write_text(json.dumps(state))
    return folder, uri


def test_resuming_a_finished_search_runs_no_trial_again(tiny_search, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    folder, uri = _copy(tiny_search, tmp_path)
    logs = sorted((folder / "proxy_runs").glob("trial-*/proxy_log.jsonl"))
    before = {p: p.read_bytes() for p in logs}
    assert logs, "the shared search left no step logs"

    assert main(["search", "--resume", str(folder), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # the whole of stdout: one JSON document

    expected = tiny_search.result.trials
    assert [t["trial_id"] for t in data["trials"]] == [t.trial_id for t in expected]
    assert [t["status"] for t in data["trials"]] == [t.status for t in expected]
    assert data["best"]["trial_id"] == tiny_search.result.best.trial_id
    assert {p: p.read_bytes() for p in logs} == before  # no worker started again
    assert len(data["pruned"]) == len(tiny_search.result.pruned)

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("tiny-search").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and "trial_id" not in r.data.tags]
    assert [r.info.run_id for r in parents] == [data["mlflow_run_id"]]
    assert parents[0].info.status == "FINISHED"
    children = sorted(r.data.tags["trial_id"] for r in runs if "trial_id" in r.data.tags)
    assert children == sorted(t.trial_id for t in expected)
