"""`python -m service search`: bad input is one line and exit 2 (no traceback, nothing lost); the
summary a person reads. Real searches through this command run in tests/search/test_resume_cli.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.cli.search import _report
from service.cluster.ports import free_port
from service.search.prune import PrunedPlan
from service.search.result import SearchResult, TrialRecord
from service.spec import Plan

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "experiments" / "tiny-cpu.yaml"


def _search(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "SERVICE_SEARCH_DIR": str(tmp_path / "searches"), **env}
    if "MLFLOW_TRACKING_URI" not in env:
        environ.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-m", "service", "search", *args],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _experiment(tmp_path: Path, uri: str) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["tracking"] = {"uri": uri, "experiment_name": "cli", "buffer_dir": str(tmp_path / "pending")}
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _space(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout == ""
    return lines[0]


@pytest.mark.parametrize(
    ("space", "words"),
    [
        ("name: s\nparams: {tp: [1], zero: [1]}\n", "params.zero: unknown field"),
        ("name: s\nparams: {}\n", "params: empty space"),
        ("name: s\nparams: {tp: [1, true]}\n", "params.tp.1: expected a number, got true/false"),
        ("# nothing\n", "empty space"),
        ("name: s\nparams: {micro_batch: [1]}\nmetric: mfu\n", "metric: Input should be"),
    ],
)
def test_bad_space_is_one_line(space: str, words: str, tmp_path: Path) -> None:
    line = _one_line_error(_search([str(TINY), "--space", str(_space(tmp_path, space))], tmp_path))
    assert words in line and "space.yaml" in line


def test_missing_inputs_are_one_line(tmp_path: Path) -> None:
    assert "--space" in _one_line_error(_search([str(TINY)], tmp_path))
    assert "no such file" in _one_line_error(
        _search([str(TINY), "--space", str(tmp_path / "no.yaml")], tmp_path)
    )
    assert "not a search folder" in _one_line_error(_search(["--resume", str(tmp_path)], tmp_path))
    space = _space(tmp_path, "name: s\nparams: {micro_batch: [1]}\n")
    assert "--max-trials" in _one_line_error(
        _search([str(TINY), "--space", str(space), "--max-trials", "0"], tmp_path)
    )


def test_every_plan_pruned_is_recorded_then_one_line(tmp_path: Path) -> None:
    # tp 4 and tp 8 cannot be laid out on the tiny proxy's 2 workers.
    space = _space(tmp_path, "name: all-pruned\nparams: {tp: [4, 8], micro_batch: [1, 2]}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    line = _one_line_error(_search([str(_experiment(tmp_path, uri)), "--space", str(space)], tmp_path))
    assert "every one of the 4 plans is pruned (invalid" in line and "recorded in MLflow run" in line
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("cli").experiment_id])
    assert sum(r.data.tags.get("trial_status") == "pruned" for r in runs) == 4
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.tags["stopped_reason"] == "every plan of the space was pruned"


def test_unreachable_tracking_store_keeps_the_records(tmp_path: Path) -> None:
    space = _space(tmp_path, "name: all-pruned\nparams: {tp: [4], micro_batch: [1, 2]}\n")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there; the environment wins over the YAML
    experiment = _experiment(tmp_path, f"sqlite:///{tmp_path / 'unused.db'}")
    proc = _search([str(experiment), "--space", str(space)], tmp_path, MLFLOW_TRACKING_URI=uri)
    line = _one_line_error(proc)
    assert "every one of the 2 plans is pruned" in line and "recorded in MLflow" not in line
    assert f"tracking store {uri} unreachable" in proc.stderr
    assert not (tmp_path / "unused.db").exists()
    # Nothing lost: the parent run, both pruned runs and their ends wait on disk for the store.
    (buffer,) = (tmp_path / "pending").glob("*.jsonl")
    ops = [json.loads(line) for line in buffer.read_text().splitlines()]
    started = [op["key"] for op in ops if op["op"] == "start_run"]
    assert started[0].startswith("search:") and sum(k.startswith("pruned:") for k in started) == 2
    assert sum(op["op"] == "end_run" for op in ops) == 3
    assert any(op["op"] == "log_artifact" and op["local_path"].endswith("experiment.yaml") for op in ops)


def test_report_lists_trials_best_pruned_and_records() -> None:
    ok = Plan(dp=2, micro_batch=2, precision="fp32")
    oom = Plan(dp=2, micro_batch=1024, precision="fp32")
    result = SearchResult(
        "tokens_per_s",
        "max",
        [
            TrialRecord(
                trial_id="aaaa1111",
                key=oom.short(),
                plan=oom,
                status="oom",
                reason="can't allocate memory",
                predicted={"tokens_per_s": 13000.0},
            ),
            TrialRecord(
                trial_id="bbbb2222",
                key=ok.short(),
                plan=ok,
                status="ok",
                steps=4,
                measured={"tokens_per_s": 1141.6},
                predicted={"tokens_per_s": 8765.8},
            ),
        ],
        [PrunedPlan({"tp": 4}, "dp·tp·pp = 4 but the proxy has 2 workers", "invalid")],
        "run123",
        "/tmp/searches/s",
        tracking={
            "uri": "sqlite:///x.db",
            "experiment": "e",
            "pending_records": 3,
            "pending_file": "/p.jsonl",
            "last_error": "ConnectionError",
        },
        stopped_reason="all 2 planned trials ran",
    )
    text = _report(result)
    assert "aaaa1111" in text and "can't allocate memory" in text and "13,000" in text
    assert f"best: {ok.short()} (tokens_per_s 1,141.6)" in text
    assert "pruned: 1 ({'invalid': 1})" in text and "mlflow: run run123" in text
    assert "3 records kept in /p.jsonl" in text and "resume or inspect: /tmp/searches/s" in text
    data = json.loads(json.dumps(result.to_dict()))  # the --json document round-trips through JSON
    assert data["best"]["trial_id"] == "bbbb2222" and data["best"]["measured"]["tokens_per_s"] == 1141.6
    assert [t["status"] for t in data["trials"]] == ["oom", "ok"]
    assert data["pruned"] == [
        {
            "plan": None,
            "point": {"tp": 4},
            "kind": "invalid",
            "reason": "dp·tp·pp = 4 but the proxy has 2 workers",
        }
    ]
    assert data["mlflow_run_id"] == "run123" and data["tracking"]["pending_records"] == 3
