"""`python -m service mlflow-server`: serves a store on loopback, takes a run over HTTP (params, metrics
and a proxied artifact that lands in --artifacts-destination), gives it back, and stops cleanly on
SIGTERM, taking its `mlflow server` with it. Exposing it on every interface is refused in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from manifest_checks import ROOT

from service.cluster.ports import free_port


def _start(tmp_path: Path, port: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "service", "mlflow-server", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp_path / 'store.db'}",
           "--artifacts-destination", str(tmp_path / "artifacts")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if line.startswith("export MLFLOW_TRACKING_URI="):
            return proc, line.split("=", 1)[1].strip()
    proc.kill()
    raise AssertionError(f"no URI printed: {''.join(lines)[-2000:]}")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_serves_a_run_over_http_and_stops_on_sigterm(tmp_path: Path):
    from mlflow import MlflowClient

    port = free_port()
    proc, uri = _start(tmp_path, port)
    try:
        assert uri == f"http://127.0.0.1:{port}"
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment("cluster-check")
        run = client.create_run(exp, run_name="from-a-driver")
        client.log_param(run.info.run_id, "plan", "z3-tp1")
        client.log_metric(run.info.run_id, "tokens_per_s", 1234.5, step=3)
        client.log_text(run.info.run_id, "hello from the driver", "notes/hello.txt")
        client.set_terminated(run.info.run_id)

        again = MlflowClient(tracking_uri=uri).get_run(run.info.run_id)  # read back over HTTP
        assert again.data.params == {"plan": "z3-tp1"} and again.data.metrics["tokens_per_s"] == 1234.5
        assert again.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied, not a client path
        stored = list((tmp_path / "artifacts").rglob("hello.txt"))
        assert len(stored) == 1 and stored[0].read_text() == "hello from the driver"
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0
    assert not _listening(port)  # the mlflow server it started went with it


@pytest.mark.parametrize("host", ["0.0.0.0", "8.8.8.8"])
def test_refuses_public_binding_in_one_line(host: str):
    proc = subprocess.run(
        [sys.executable, "-m", "service", "mlflow-server", "--host", host],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--host" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_server_that_dies_is_started_again_on_the_same_port(tmp_path: Path):
    """The head's container has no process supervisor: the command is one. Its `mlflow server` killed
    (as the OOM killer would), it comes back on the same URL with the same store."""
    import psutil
    from mlflow import MlflowClient

    port = free_port()
    proc, uri = _start(tmp_path, port)
    try:
        run = MlflowClient(tracking_uri=uri).create_run(MlflowClient(tracking_uri=uri).create_experiment("e"))
        servers = [c for c in psutil.Process(proc.pid).children() if "mlflow" in " ".join(c.cmdline())]
        assert len(servers) == 1
        os.killpg(servers[0].pid, signal.SIGKILL)  # the server and its workers
        deadline, lines = time.monotonic() + 120, []
        while time.monotonic() < deadline and proc.stdout is not None:
            lines.append(proc.stdout.readline())
            if lines[-1].startswith(f"MLflow server on {uri} again"):
                break
        assert lines and lines[-1].startswith(f"MLflow server on {uri} again"), "".join(lines)[-2000:]
        assert any("mlflow server exited (code -9); starting it again" in ln for ln in lines)
        assert MlflowClient(tracking_uri=uri).get_run(run.info.run_id).info.run_id == run.info.run_id
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0 and not _listening(port)


def test_a_taken_port_is_refused_in_one_line_not_reported_as_this_server():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "service", "mlflow-server", "--port", str(port)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""  # no "export MLFLOW_TRACKING_URI=" for another server
    assert proc.stderr.strip().splitlines() == [
        f"error: --port: port {port} on 127.0.0.1 is taken (Address already in use): stop what listens "
        "there, or give another --port"
    ]


def test_why_the_server_did_not_start_reaches_stderr(tmp_path: Path):
    (tmp_path / "a-file").write_text("")
    store = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"  # its folder cannot be made
    proc = subprocess.run([sys.executable, "-m", "service", "mlflow-server", "--port", str(free_port()),
                           "--no-restart", "--backend-store-uri", store],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and "Error initializing" in proc.stderr  # the server's own reason
    assert proc.stderr.strip().splitlines()[-1] == "error: mlflow server: mlflow server exited with code 1"


def test_an_ipv6_host_is_bracketed_in_the_url():
    from service.tracking.server import server_url

    assert server_url("::1", 5000) == "http://[::1]:5000"
    assert server_url("127.0.0.1", 5000) == "http://127.0.0.1:5000"


def test_an_address_this_machine_lacks_is_a_host_error_not_a_taken_port():
    cmd = [
        sys.executable,
        "-m",
        "service",
        "mlflow-server",
        "--host",
        "10.255.255.1",
        "--port",
        str(free_port()),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --host: cannot listen on 10.255.255.1")


def test_a_port_that_needs_privileges_is_a_port_error(monkeypatch):
    import errno

    from service.tracking import server

    class Refusing:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def setsockopt(self, *args):
            pass

        def bind(self, address):
            raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(server.socket, "socket", Refusing)
    with pytest.raises(RuntimeError, match="port 80 needs privileges: Permission denied"):
        server.check_port_free("127.0.0.1", 80)
