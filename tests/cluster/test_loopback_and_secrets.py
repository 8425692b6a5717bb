"""A local Ray started by the service (`ensure_ray`) listens on loopback only, and credentials in the
service's environment reach no log Ray or the service writes (issue #35).

One fresh Python process, with fake AWS and Hugging Face credentials in its environment, starts Ray
through `service.train.ray_session.ensure_ray`, runs a remote task and a one-trial Ray Tune run, and
lists the listening TCP sockets of itself and every process below it (GCS, raylet, dashboard head and
agent, runtime-env agent, autoscaler monitor, log monitor, workers). The tests then read those sockets
and every file under the Ray session's folder, the Tune results and the process's own output.
Before the fix, the GCS, raylet, workers and dashboard agent listened on `::`/0.0.0.0, the monitor's and
dashboard's metrics servers on 0.0.0.0, the runtime-env agent on the machine's address, and the fake
AWS secret stood in runtime_env_agent.log.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.cluster.ports import free_port

ROOT = Path(__file__).resolve().parents[2]

PLANTED = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEDONOTLOG0001",
    "AWS_SECRET_ACCESS_KEY": "fake-secret-DO-NOT-LOG-1234",
    "AWS_SESSION_TOKEN": "fake-session-DO-NOT-LOG-5678",
    "HF_TOKEN": "hf_fakeDONOTLOGtoken9012",
    "HUGGING_FACE_HUB_TOKEN": "hf_fakeDONOTLOGhub3456",
}

PROBE = r"""
import hashlib, json, os, sys, time
import psutil, ray
from service.cluster.secrets import is_secret
from service.train.ray_session import ensure_ray

DIGESTS = json.loads(sys.argv[2])  # of the planted values: the tasks compare, and carry no value along

def seen():
    digest = lambda value: hashlib.sha256(value.encode()).hexdigest()
    return sorted(k for k, d in DIGESTS.items() if digest(os.environ.get(k, "")) == d)

assert ensure_ray(num_cpus=2)
out = {"node_ip": ray.util.get_node_ip_address(),
       "session_dir": ray._private.worker._global_node.get_session_dir_path(), "listening": {}}

def listening():
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            name = " ".join(" ".join(proc.cmdline()).split())[:160]
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    out["listening"][f"{conn.laddr.ip}|{conn.laddr.port}|{proc.pid}"] = name
        except psutil.Error:
            pass  # a worker that exited meanwhile

@ray.remote
def task_env():
    return seen()

out["task_sees"] = ray.get(task_env.remote())
listening()

from ray import tune

def trainable(config):
    runtime_env = ray.get_runtime_context().runtime_env.get("env_vars") or {}
    tune.report({"sees": ",".join(seen()),
                 "runtime_env_secrets": ",".join(sorted(k for k in runtime_env if is_secret(k)))})

results = tune.Tuner(
    trainable, run_config=tune.RunConfig(storage_path=sys.argv[1], name="probe", verbose=0)
).fit()
out["trial"] = {k: results[0].metrics[k] for k in ("sees", "runtime_env_secrets")}
metrics_ports = {os.environ["AUTOSCALER_METRIC_PORT"], os.environ["DASHBOARD_METRIC_PORT"]}
deadline = time.monotonic() + 30  # the dashboard head starts its metrics server last, seconds in
while True:
    listening()
    if metrics_ports <= {key.split("|")[1] for key in out["listening"]} or time.monotonic() > deadline:
        break
    time.sleep(0.5)
ray.shutdown()
print("PROBE " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What one local Ray of the service showed (see the module docstring); its output as `stdout`."""
    results = tmp_path_factory.mktemp("tune-results")
    digests = {k: hashlib.sha256(v.encode()).hexdigest() for k, v in PLANTED.items()}
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SERVICE_RAY_CORES")}
    env.update(PLANTED)
    # The autoscaler's and the dashboard's metrics servers on free ports, so that they do listen even
    # where another Ray holds their fixed defaults (44217, 44227).
    env["AUTOSCALER_METRIC_PORT"], env["DASHBOARD_METRIC_PORT"] = (str(free_port()) for _ in range(2))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(results), json.dumps(digests)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("PROBE "))
    out["results_dir"] = str(results)
    out["output"] = proc.stdout + proc.stderr
    return out


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1, as gRPC's dual-stack sockets show 127.0.0.1
    return ip.is_loopback


def test_is_loopback() -> None:
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("::ffff:127.0.0.1")
    assert not any(map(_is_loopback, ["0.0.0.0", "::", "192.0.2.2", "::ffff:192.0.2.2"]))


@pytest.mark.slow
def test_a_local_ray_of_the_service_listens_on_loopback_only(probe: dict[str, Any]) -> None:
    listening = {tuple(key.split("|")): name for key, name in probe["listening"].items()}
    outside = {f"{ip}:{port} ({name})" for (ip, port, _), name in listening.items() if not _is_loopback(ip)}
    assert not outside, f"listening beyond loopback: {sorted(outside)}"
    names = " ".join(listening.values())
    parts = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "monitor.py", "dashboard.py")
    assert all(part in names for part in parts), listening  # each of them was found listening
    assert probe["node_ip"] == "127.0.0.1"
    raylet_out = Path(probe["session_dir"], "logs", "raylet.out").read_text()
    assert "node_manager address: 127.0.0.1:" in raylet_out


@pytest.mark.slow
def test_planted_credentials_reach_no_log_and_no_runtime_env(probe: dict[str, Any]) -> None:
    searched = 0
    found = []
    for folder in (Path(probe["session_dir"]), Path(probe["results_dir"])):
        for path in folder.rglob("*"):
            if path.is_file() and not path.is_symlink():
                searched += 1
                data = path.read_bytes()
                found += [f"{path}: {name}" for name, value in PLANTED.items() if value.encode() in data]
    found += [f"probe output: {name}" for name, value in PLANTED.items() if value in probe["output"]]
    assert searched > 20 and (Path(probe["session_dir"]) / "logs" / "runtime_env_agent.log").is_file()
    assert not found, found
    # The workers have them all the same, inherited from the service's environment through the raylet.
    assert probe["task_sees"] == sorted(PLANTED)
    assert probe["trial"] == {"sees": ",".join(sorted(PLANTED)), "runtime_env_secrets": ""}


def test_tune_copies_no_credentials_into_a_trials_runtime_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.tune.execution.class_cache import _ActorClassCache

    from service.cluster.secrets import is_secret, keep_secrets_out_of_trials

    keep_secrets_out_of_trials()
    for name, value in PLANTED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")  # what Tune is still to pass on

    class Trainable:
        pass

    env_vars = _ActorClassCache().get(Trainable)._default_options["runtime_env"]["env_vars"]
    assert env_vars.get("RAY_TRAIN_V2_ENABLED") == "1"
    assert not [k for k in env_vars if is_secret(k)], env_vars
    assert keep_secrets_out_of_trials() == []  # a second call has nothing left to take out
    assert is_secret("AWS_SECRET_ACCESS_KEY") and is_secret("hf_token") and not is_secret("RAY_ADDRESS")
