"""`python -m service mlflow-server` on a real PostgreSQL store (issue #34: one tracking database for a
cluster), on a throwaway server (tests/cluster/local_postgres.py: 127.0.0.1, a free port, its own temp
dir): it takes a plain `postgresql://` URI (the password left to libpq's PGPASSWORD), does not print the
password, and what a client logs through it lands in PostgreSQL's tables. A search recorded through such
a server, as a job on a cluster, is tests/cluster/test_job_submit.py's.

Skipped, with the reason, where PostgreSQL is not installed (`.ci/test` installs it on Debian).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from local_postgres import LocalPostgres, table_rows
from manifest_checks import ROOT

from service.cluster.ports import free_port


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
    assert table_rows(postgres_uri, "SELECT status FROM runs WHERE run_uuid = %s", run.info.run_id) == [
        ("FINISHED",)
    ]
