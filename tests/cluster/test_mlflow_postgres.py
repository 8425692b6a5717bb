"""MLflow's tracking server on a real PostgreSQL store (issue #34: one tracking database for a cluster),
on a throwaway server (tests/cluster/local_postgres.py: 127.0.0.1, a free port, its own temp dir):

- a tiny search, its MLFLOW_TRACKING_URI the server's URL, records its parent and trial runs, their
  metrics and their proxied artifacts; MlflowClient reads them back over HTTP, and PostgreSQL's own
  `runs` and `metrics` tables hold them (so the server did not quietly use a sqlite file);
- `python -m service mlflow-server` takes a plain `postgresql://` URI (the password left to libpq's
  PGPASSWORD) and does not print the password.

Skipped, with the reason, where PostgreSQL is not installed (`.ci/test` installs it on Debian).
"""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from local_postgres import LocalPostgres, bin_dir, local_postgres
from manifest_checks import ROOT

from service.cluster.ports import free_port

NAME = "tiny-cpu-postgres"


@pytest.fixture(scope="module")
def postgres() -> Iterator[LocalPostgres]:
    """One server for the module (about a second to start); each test gets a database of its own."""
    if bin_dir() is None:
        pytest.skip("PostgreSQL is not installed: no initdb on PATH or under /usr/lib/postgresql/*/bin "
                    "(CI setup: apt-get install -y postgresql)")  # fmt: skip
    with local_postgres() as server:
        yield server


@pytest.fixture
def postgres_uri(postgres: LocalPostgres) -> str:
    """A fresh, empty database on the module's server, as MLflow takes it (`postgresql+psycopg://`)."""
    name = f"t_{secrets.token_hex(4)}"
    postgres.create_database(name)
    return postgres.sqlalchemy_uri(name)


def _rows(sqlalchemy_uri: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows straight from PostgreSQL, past MLflow (psycopg takes the URI without SQLAlchemy's `+psycopg`)."""
    import psycopg

    with psycopg.connect(sqlalchemy_uri.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
        return conn.execute(sql, params).fetchall()


def _tiny_search_files(tmp: Path) -> tuple[Path, Path]:
    """tiny-cpu with 3 steps and one plan: the smallest search that runs a real trial."""
    experiment = yaml.safe_load((ROOT / "experiments/tiny-cpu.yaml").read_text())
    experiment["name"] = NAME
    experiment["proxy"].update({"steps": 3, "warmup_steps": 1, "memory_limit_gib": 2})
    # No uri: it comes from MLFLOW_TRACKING_URI; pending records (if the server failed) under tmp.
    experiment["tracking"] = {"experiment_name": NAME, "buffer_dir": str(tmp / "pending")}
    space = {"name": "one-plan", "params": {"zero_stage": [1], "offload_optimizer": [False], "tp": [1],
             "micro_batch": [2], "grad_accum": [1], "recompute": ["none"]},
             "search": {"steps": 3, "max_trials": 1, "trial_timeout_s": 240}}  # fmt: skip
    (tmp / "experiment.yaml").write_text(yaml.safe_dump(experiment))
    (tmp / "space.yaml").write_text(yaml.safe_dump(space))
    return tmp / "experiment.yaml", tmp / "space.yaml"


@pytest.mark.slow  # one 3-step proxy trial on a local Ray, and an MLflow server (~1 min on 2 cores)
def test_a_search_recorded_through_the_server_lands_in_postgresql(
    postgres_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    from service.search import RunConfig, Search
    from service.tracking.server import mlflow_server

    experiment, space = _tiny_search_files(tmp_path)
    artifacts, log = tmp_path / "artifacts", tmp_path / "mlflow.log"
    with mlflow_server(postgres_uri, artifacts_destination=artifacts, log_path=log) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        result = Search(experiment, space, run_config=RunConfig(storage_path=tmp_path / "searches")).fit()
        # Every record reached the server: none waits in the local backlog.
        assert result.tracking["online"] and result.tracking["pending_records"] == 0, log.read_text()[-3000:]
        client = MlflowClient(tracking_uri=url)  # what the UI through a tunnel shows
        exp = client.get_experiment_by_name(NAME)
        assert exp is not None and exp.artifact_location.startswith("mlflow-artifacts:")
        runs = client.search_runs([exp.experiment_id])
        parent = client.get_run(str(result.mlflow_run_id))
        trial = next(r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
        history = client.get_metric_history(trial.info.run_id, "measured_tokens_per_s")
        parent_artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}

    assert parent.data.metrics["num_ok"] == 1 and parent.data.metrics["best_tokens_per_s"] > 0
    assert [m.step for m in history] == [1, 2, 3] and history[-1].value > 0
    assert {"result.json", "trials.csv"} <= parent_artifacts
    assert list(artifacts.rglob("result.json"))  # proxied into the server's artifact store

    # The same runs, as rows of MLflow's tables in PostgreSQL.
    stored = _rows(postgres_uri, "SELECT run_uuid, status FROM runs WHERE experiment_id = %s",
                   int(exp.experiment_id))  # fmt: skip
    assert {run_id for run_id, _ in stored} == {r.info.run_id for r in runs}
    assert dict(stored)[parent.info.run_id] == "FINISHED"
    steps = _rows(postgres_uri, "SELECT step, value FROM metrics WHERE run_uuid = %s AND key = %s "
                  "ORDER BY step", trial.info.run_id, "measured_tokens_per_s")  # fmt: skip
    assert [(step, value) for step, value in steps] == [(m.step, m.value) for m in history]


def _start_cli(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[str], str, list[str]]:
    """`python -m service mlflow-server ...` until it prints the URI to export; its output so far."""
    cmd = [sys.executable, "-m", "service", "mlflow-server", *args]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline, lines = time.monotonic() + 120, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if line.startswith("export MLFLOW_TRACKING_URI="):
            return proc, line.split("=", 1)[1].strip(), lines
    proc.kill()
    raise AssertionError(f"no URI printed: {''.join(lines)[-2000:]}")


@pytest.mark.slow  # an MLflow server (~10-20 s to answer on 2 cores)
def test_the_cli_takes_a_plain_postgresql_uri_and_keeps_the_password_off_its_output(
    postgres: LocalPostgres, postgres_uri: str, tmp_path: Path
) -> None:
    import os

    from mlflow import MlflowClient

    database = postgres_uri.rsplit("/", 1)[1]
    plain = (
        f"postgresql://{postgres.user}@{postgres.host}:{postgres.port}/{database}"  # no driver, no password
    )
    env = {**os.environ, "PGPASSWORD": postgres.password}  # libpq's, read by psycopg
    proc, url, lines = _start_cli(env, "--port", str(free_port()), "--backend-store-uri", plain,
                                  "--artifacts-destination", str(tmp_path / "artifacts"))  # fmt: skip
    try:
        client = MlflowClient(tracking_uri=url)
        run = client.create_run(client.create_experiment("from-the-cli"), run_name="a-driver")
        client.log_metric(run.info.run_id, "tokens_per_s", 1234.5, step=1)
        client.set_terminated(run.info.run_id)
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0
    printed = "".join(lines) + rest
    assert f"store postgresql+psycopg://{postgres.user}@" in printed and postgres.password not in printed
    assert _rows(postgres_uri, "SELECT status FROM runs WHERE run_uuid = %s", run.info.run_id) == [
        ("FINISHED",)
    ]
