"""A throwaway Ray head for tests: `ray start --head --block` on 127.0.0.1, token auth with a token of
its own, every port picked free, its own short temp dir; stopped by signalling the process (and its
process group) this module started, never with `ray stop`, which would stop other people's clusters.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from service.cluster.ports import free_port


@dataclass(frozen=True)
class LocalCluster:
    dashboard_url: str
    gcs_address: str
    token: str
    temp_dir: Path
    log: Path

    @property
    def env(self) -> dict[str, str]:
        """Environment for a client of this cluster (token auth, this token)."""
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_ADDRESS": ""}


def _ours(temp_dir: Path) -> list[int]:
    """Pids of processes whose command line names this cluster's temp dir (started by it)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(temp_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def _wait_dashboard(url: str, token: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(request, timeout=3) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    tail = log.read_text()[-3000:]
    raise TimeoutError(f"Ray dashboard at {url} did not answer in {timeout_s:.0f} s: {tail}")


@contextmanager
def ray_head(
    num_cpus: int,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Iterator[LocalCluster]:
    temp_dir = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths are limited
    token = secrets.token_hex(32)
    # Below the kernel's ephemeral range (service/cluster/ports.py): the agents bind theirs seconds after
    # this, and a busy machine's outgoing connections must not take them meanwhile.
    chosen: list[int] = [port] if port else []
    for _ in range(11 - len(chosen)):
        chosen.append(free_port(taken=chosen))
    port, dash, autoscaler_metrics, dashboard_metrics, *rest = chosen
    names = (
        "ray-client-server-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
        "node-manager-port",
        "object-manager-port",
    )
    ports = dict(zip(names, map(str, rest), strict=True))  # fmt: skip
    cmd = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
           f"--port={port}", f"--dashboard-port={dash}", f"--num-cpus={num_cpus}", "--num-gpus=0",
           f"--temp-dir={temp_dir}", "--include-dashboard=true", "--disable-usage-stats",
           *[f"--{k}={v}" for k, v in ports.items()], *(extra_args or [])]  # fmt: skip
    log = temp_dir / "ray-start.log"
    run_env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, **(env or {})}
    # The monitor's and the dashboard's metrics servers default to fixed ports (44217, 44227) every
    # other Ray head on the machine wants too (they log the clash and go on without metrics).
    run_env |= {"AUTOSCALER_METRIC_PORT": str(autoscaler_metrics),
                "DASHBOARD_METRIC_PORT": str(dashboard_metrics)}  # fmt: skip
    run_env.pop("RAY_ADDRESS", None)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=run_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster = LocalCluster(f"http://127.0.0.1:{dash}", f"127.0.0.1:{port}", token, temp_dir, log)
    try:
        _wait_dashboard(cluster.dashboard_url, token, proc, log, timeout_s=120)
        yield cluster
    except BaseException as err:
        # `ray start --block` ends the whole cluster when one of its processes exits unexpectedly (the
        # dashboard, the autoscaler's monitor, ...); its log names which one, with that process's stderr.
        if proc.poll() is not None:
            err.add_note(f"ray start exited {proc.returncode} during the test: {log.read_text()[-4000:]}")
        raise
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            # A graceful stop after jobs ran took 30 s in CI; the test is over, so past 10 s kill it.
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything left in the group it led
        for pid in _ours(temp_dir):  # workers that left the group, named by our temp dir
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
