"""Serve the MLflow UI and REST API for a store on 127.0.0.1 (never on other interfaces).

`python -m service.tracking.server [--port P]` serves the embedded default store
(`sqlite:///<repo>/mlflow.db`, artifacts in `<repo>/mlartifacts`); tests use `mlflow_server(...)` to
serve a store of their own on a free port.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from service.cluster.ports import free_port
from service.tracking.uri import default_uri, repo_root


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until `proc`'s server answers; an answer counts only while `proc` still runs (another server on
    the port would answer for a process that has already died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200 and proc.poll() is None:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"mlflow server at {url} did not answer within {timeout_s:.0f} s")


def check_port_free(host: str, port: int) -> None:
    """A RuntimeError when something already listens on host:port: the server would fail to bind while
    the one already there answered its health check in its place."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a server that just stopped is no owner
        try:
            probe.bind((host, port))
        except OSError as err:
            if err.errno == errno.EACCES:  # a port below 1024 without root
                raise RuntimeError(f"port {port} needs privileges: {err.strerror}") from None
            if err.errno != errno.EADDRINUSE:  # an address this machine does not have, a name
                raise ValueError(f"cannot listen on {host} ({err.strerror or err})") from None
            raise RuntimeError(f"port {port} on {host} is taken ({err.strerror or err}): stop what listens "
                               "there, or give another --port") from None  # fmt: skip


def server_url(host: str, port: int) -> str:
    """The server's URL; an IPv6 address in brackets (RFC 3986), as MLflow's client requires."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _stderr() -> int:
    """This process's stderr as a file descriptor for the server's output (DEVNULL where it has none)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured or replaced stream
        return subprocess.DEVNULL


@contextmanager
def mlflow_server(
    backend_store_uri: str,
    port: int | None = None,
    artifacts_destination: str | Path | None = None,
    log_path: Path | None = None,
    timeout_s: float = 90.0,
    host: str = "127.0.0.1",
    serve_artifacts: bool = True,
) -> Iterator[str]:
    """Runs `mlflow server` on `host` (127.0.0.1 unless told) for the duration of the block; yields its URL.

    With `serve_artifacts` the server proxies artifact uploads and downloads to `artifacts_destination`,
    so clients need no access to the artifact store itself.
    """
    with mlflow_server_process(
        backend_store_uri, port, artifacts_destination, log_path, timeout_s, host, serve_artifacts
    ) as (url, _):
        yield url


@contextmanager
def mlflow_server_process(
    backend_store_uri: str,
    port: int | None = None,
    artifacts_destination: str | Path | None = None,
    log_path: Path | None = None,
    timeout_s: float = 90.0,
    host: str = "127.0.0.1",
    serve_artifacts: bool = True,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`mlflow_server`, yielding the server's process too (a supervisor waits on it). `log_path` None: the
    server's output goes to this process's stderr (the reason it fails to start is there)."""
    port = port or free_port()
    check_port_free(host, port)
    url = server_url(host, port)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    cmd.append("--serve-artifacts" if serve_artifacts else "--no-serve-artifacts")
    if artifacts_destination is not None and serve_artifacts:
        cmd += ["--artifacts-destination", str(artifacts_destination)]
    log = open(log_path, "w") if log_path else _stderr()  # noqa: SIM115 - closed below
    # MLflow 3's server also starts a job runner (scheduled scoring, trace archival) on the same store;
    # we use none of it, and with it and a sqlite store, searches run as jobs were seen to stall for minutes.
    # The store reaches the server through its environment (`mlflow server` reads
    # MLFLOW_BACKEND_STORE_URI), not its command line, where `ps` would show a password in the URI.
    env = {
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        **os.environ,
        "MLFLOW_BACKEND_STORE_URI": backend_store_uri,
    }
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        _wait_healthy(url, proc, timeout_s)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the server's own process group (uvicorn workers)
            proc.wait(timeout=15)
        # A server that died (killed, out of memory) can leave its workers holding the port.
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, 9)
        if log_path:
            log.close()  # type: ignore[union-attr]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--backend-store-uri", default=default_uri())
    args = parser.parse_args(argv)
    with mlflow_server(args.backend_store_uri, args.port, repo_root() / "mlartifacts") as url:
        print(f"MLflow UI: {url} (Ctrl-C to stop)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
