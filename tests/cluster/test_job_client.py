"""`submit` against a stand-in job client (no Ray): what it refuses before submitting (files the job
would not have, a password Ray would log), how it waits (a job API that stops answering, a log fetched
less often as it grows) and what --json prints."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.cluster import jobs
from service.cluster.jobs import Job, JobApiLost, check_files, job_env, last_json_document, wait_for_job
from service.spec.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["python", "-m", "service", "plan"]


def test_files_are_checked_in_either_option_form_and_must_be_in_the_working_dir(tmp_path: Path):
    check_files([*PLAN, "--space=search_spaces/tiny-cpu.yaml", "experiments/tiny-cpu.yaml"], ROOT)
    check_files([*PLAN, str(ROOT / "experiments/tiny-cpu.yaml")], ROOT)  # shared storage: as it is
    (tmp_path / "shared.yaml").write_text("name: x\n")
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "linked.yaml").symlink_to(tmp_path / "shared.yaml")  # Ray uploads what it points to
    check_files([*PLAN, "linked.yaml"], tmp_path / "wd")
    for arg, says in [
        ("--space=search_spaces/nope.yaml", "no such file"),
        ("../elsewhere/tiny-cpu.yaml", "outside"),
        (str(ROOT / "experiments/nope.yaml"), "no such file"),
    ]:
        with pytest.raises(SpecError, match=says) as err:
            check_files([*PLAN, arg], ROOT)
        assert err.value.field == "entrypoint"


def test_a_tracking_uri_with_a_password_is_not_sent_to_the_job(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SpecError, match="holds a password") as err:
        job_env({"MLFLOW_TRACKING_URI": "postgresql://mlflow:Sup3rS3cret@10.0.0.5:5432/mlflow"})
    assert "Sup3rS3cret" not in str(err.value)
    assert job_env({"MLFLOW_TRACKING_URI": "postgresql://mlflow@10.0.0.5:5432/mlflow"})


class Client:
    """A job that runs for `polls` status calls, printing a line per call; `down_after`: the API stops
    answering after that many calls."""

    def __init__(self, polls: int, down_after: int | None = None, line: str = "x" * 99) -> None:
        self.polls, self.down_after, self.line = polls, down_after, line
        self.status_calls = self.log_calls = 0

    def _call(self) -> None:
        if self.down_after is not None and self.status_calls + self.log_calls >= self.down_after:
            raise ConnectionError("Connection refused")

    def get_job_status(self, job_id: str) -> SimpleNamespace:
        self._call()
        self.status_calls += 1
        return SimpleNamespace(value="SUCCEEDED" if self.status_calls >= self.polls else "RUNNING")

    def get_job_logs(self, job_id: str) -> str:
        self._call()
        self.log_calls += 1
        return (self.line + "\n") * (1000 * self.status_calls)

    def stop_job(self, job_id: str) -> None: ...


def test_a_job_api_that_stops_answering_is_asked_again_then_lost(monkeypatch):
    monkeypatch.setattr(jobs, "LOST_API_S", 0.05)
    with pytest.raises(JobApiLost, match="Connection refused"):
        wait_for_job(Job("http://h:8265", "raysubmit_1", Client(polls=10**6, down_after=3)), poll_s=0.01)


def test_a_growing_log_is_fetched_less_often_and_all_of_it_is_shown(monkeypatch):
    monkeypatch.setattr(jobs, "LOG_BYTES_PER_S", 1e6)  # 100 kB more log per poll: 0.1 s more between fetches
    client, seen = Client(polls=60), []
    outcome = wait_for_job(Job("http://h:8265", "raysubmit_1", client), on_output=seen.append, poll_s=0.01)
    assert outcome.status == "SUCCEEDED" and "".join(seen) == outcome.logs
    assert client.log_calls < client.status_calls / 3


def test_the_last_json_document_is_found_among_rays_lines_and_stderr():
    doc = {"selected": {"plan": "dp4-z3"}, "ranked": [1, 2]}
    logs = "2026-12-07 11:00:00,000 INFO job_manager.py:581 -- Runtime env is setting up.\n"
    logs += "Running entrypoint for job raysubmit_1: python -m service plan x.yaml --json\n"
    logs += json.dumps(doc, indent=2) + "\nsome warning on stderr\n"
    assert last_json_document(logs) == doc
    assert last_json_document("no json here\n{not json\n") is None


def test_submit_json_prints_one_document_and_a_lost_api_exits_3(monkeypatch, capsys):
    from service.cli.main import main

    monkeypatch.setattr(jobs, "check_reachable", lambda address: None)
    monkeypatch.setattr(jobs, "LOST_API_S", 0.05)
    client = Client(polls=2, line='{"answer": 42}')
    monkeypatch.setattr(jobs, "client_for", lambda address, token=None: client)
    client.submit_job = lambda entrypoint, runtime_env, **_: "raysubmit_1"  # type: ignore[attr-defined]
    assert main(["submit", "--json", "--", *PLAN, "experiments/tiny-cpu.yaml", "--json"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # one document: the job's output went to stderr
    assert (doc["job_id"], doc["status"], doc["output"]) == ("raysubmit_1", "SUCCEEDED", {"answer": 42})

    down = Client(polls=10**6, down_after=2)
    down.submit_job = lambda entrypoint, runtime_env, **_: "raysubmit_2"  # type: ignore[attr-defined]
    monkeypatch.setattr(jobs, "client_for", lambda address, token=None: down)
    assert main(["submit", "--", *PLAN, "experiments/tiny-cpu.yaml"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: lost the job API") and "`ray job stop raysubmit_2`" in err
    down.status_calls = down.log_calls = 0
    assert main(["submit", "--json", "--", *PLAN, "experiments/tiny-cpu.yaml"]) == 3
    lost = json.loads(capsys.readouterr().out)  # still one document, with the id of a job that may run
    assert lost["job_id"] == "raysubmit_2" and lost["status"] == "UNKNOWN"
