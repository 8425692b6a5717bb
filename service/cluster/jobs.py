"""Submits `python -m service ...` to a Ray cluster's job API, with what its driver needs to leave its
results where the user can see them, and fails fast, in one line, on what would only fail later.

A job runs in a temporary copy of the working dir on the head; anything it writes relative to the repo
(`sqlite:///<repo>/mlflow.db`, `ray_results/`) vanishes with the cluster. So the job gets, through
`runtime_env.env_vars`: `MLFLOW_TRACKING_URI` (an `http://` server such as `python -m service
mlflow-server` on the head, or an absolute `sqlite:///` path on a shared file system) and, when set,
`SERVICE_SEARCH_DIR` / `SERVICE_STORAGE_PATH` (shared storage for searches and checkpoints).

Example:
    >>> job = submit_job("http://127.0.0.1:8265", ["python", "-m", "service", "plan",
    ...                  "experiments/llama2-13b-32xh100.yaml", "--json"])      # doctest: +SKIP
    >>> wait_for_job(job).status                                                 # doctest: +SKIP
    'SUCCEEDED'
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
FORWARDED_ENV = ("MLFLOW_TRACKING_URI", "SERVICE_SEARCH_DIR", "SERVICE_STORAGE_PATH")
# Local state that must not travel with the working dir (and would only be lost on the head).
# `.env`: a developer's secrets must not travel with the job's working dir to the cluster's storage.
EXCLUDES = [".git", "mlflow.db", "mlartifacts", "mlruns", "ray_results", ".whl", "**/__pycache__",
            ".mypy_cache", ".ruff_cache", ".pytest_cache", ".benchmarks", "benchmarks/results",
            ".env"]  # fmt: skip
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# The head's job API answers 500 with this text when no job agent has registered within its own 10 s
# wait (ray/dashboard/modules/job/job_head.py, WAIT_AVAILABLE_AGENT_TIMEOUT): a head that has just
# started, or a busy one. It is Ray's "please try again later", so submit_job does, for a minute.
NO_AGENT_YET = "No available agent to submit job"
AGENT_WAIT_S = 60.0
AGENT_RETRY_INTERVAL_S = 2.0
# A head that has just started, or a loaded one, may close the connection before it answers (requests'
# "Connection aborted." / RemoteDisconnected): the job is sent again, under the same submission id, so a
# job the head did accept is found ("already exists") instead of started twice.
DROPPED = ("Connection aborted", "RemoteDisconnected", "Connection reset", "Connection refused")
LOST_API_S = 60.0  # how long a job API that stops answering is asked again
LOG_BYTES_PER_S = 1e6  # the average rate at which the (whole) log may be fetched again


@dataclass
class Job:
    """A submitted job: where, its id, and the client that talks to its cluster."""

    address: str
    job_id: str
    client: Any = field(repr=False)


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    status: str
    logs: str
    wall_s: float

    @property
    def last_line(self) -> str:
        """The job's last non-empty log line: for a failed `service` command, its one-line error."""
        lines = [line for line in self.logs.splitlines() if line.strip()]
        return lines[-1] if lines else ""


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """One TCP connect to the job API; a `SpecError` naming the address when nothing answers."""
    parsed = urllib.parse.urlparse(address if "://" in address else f"http://{address}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise SpecError("--address", f"{address!r} is not a job API URL like {DEFAULT_ADDRESS}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        reason = getattr(err, "strerror", None) or type(err).__name__
        raise SpecError(
            "--address",
            f"no Ray job API at {address} ({reason}); is the cluster up, and is "
            "`ray dashboard ray_cluster.yaml` (or kubectl port-forward) forwarding the port?",
        ) from None


def check_files(entrypoint: Sequence[str], working_dir: Path) -> None:
    """Every YAML the command names (`X.yaml` or `--opt=X.yaml`) exists: a relative path inside the
    working dir (the job runs in a copy of that folder, so one that leaves it names what the job will not
    have), an absolute one here (on a cluster it must be on storage the head shares, as SERVICE_SEARCH_DIR
    is)."""
    for token in entrypoint:
        arg = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        if not arg.endswith((".yaml", ".yml")):
            continue
        path = Path(arg) if Path(arg).is_absolute() else working_dir / arg
        # By the path as written: a symlink inside the folder is uploaded as what it points to.
        if not Path(arg).is_absolute() and os.path.normpath(arg).split(os.sep)[0] == "..":
            raise SpecError("entrypoint", f"{arg}: outside {working_dir}, the only folder the job gets")
        if not path.is_file():
            raise SpecError("entrypoint", f"{arg}: no such file (in {working_dir})")


def job_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables forwarded to the job: FORWARDED_ENV from this environment, then `env`.

    A relative sqlite URI would resolve inside the job's temporary working dir: refused.
    """
    out = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    out.update(env or {})
    uri = out.get("MLFLOW_TRACKING_URI", "")
    if urllib.parse.urlsplit(uri).password:  # Ray writes a job's env vars to its logs and `ray job list`
        raise SpecError(
            "MLFLOW_TRACKING_URI",
            "holds a password, which Ray would write to the head's logs and show in `ray job list`; give "
            "the URI without it and keep the password on the head (PGPASSWORD, ~/.pgpass), or use the "
            "http:// URL of `python -m service mlflow-server`",
        )
    if uri.startswith("sqlite:") and not uri.startswith("sqlite:////"):
        raise SpecError(
            "MLFLOW_TRACKING_URI",
            f"{uri} is relative: the job would write it inside its temporary copy of the working dir; "
            "give an absolute sqlite:////path or the http:// URL of `python -m service mlflow-server`",
        )
    return out


def client_for(address: str, token: str | None = None) -> Any:
    """Ray's `JobSubmissionClient`; with `token` it is sent as the bearer token (else Ray's own lookup:
    RAY_AUTH_MODE=token with ~/.ray/auth_token or RAY_AUTH_TOKEN)."""
    import logging

    from ray.job_submission import JobSubmissionClient

    logging.getLogger("ray").setLevel(logging.WARNING)  # not a line per file of the working dir
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return JobSubmissionClient(address, headers=headers)


def submit_job(
    address: str,
    entrypoint: Sequence[str],
    *,
    working_dir: str | Path = ".",
    env: dict[str, str] | None = None,
    token: str | None = None,
) -> Job:
    """Checks the address and the files the command names, then submits it with the working dir."""
    if not entrypoint:
        raise SpecError("entrypoint", "give the command after --, e.g. -- python -m service plan X.yaml")
    root = Path(working_dir).resolve()
    check_files(entrypoint, root)
    env_vars = job_env(env)
    check_reachable(address)
    runtime_env = {"working_dir": str(root), "excludes": EXCLUDES, "env_vars": env_vars}
    deadline = time.monotonic() + AGENT_WAIT_S
    submission_id = f"raysubmit_{secrets.token_hex(8)}"
    dropped = False
    while True:
        client = None
        try:
            client = client_for(address, token)
            job_id = client.submit_job(
                entrypoint=shlex.join(entrypoint), runtime_env=runtime_env, submission_id=submission_id
            )
            return Job(address, job_id, client)
        except Exception as err:  # Ray raises RuntimeError / requests errors with multi-line texts
            text = str(err)
            first = next((line for line in text.splitlines() if line.strip()), type(err).__name__)
            if dropped and client is not None and "already exists" in text:
                return Job(address, submission_id, client)  # the dropped request had gone through
            retry = NO_AGENT_YET in first or any(sign in text for sign in DROPPED)
            if retry and time.monotonic() < deadline:
                dropped = dropped or NO_AGENT_YET not in first
                time.sleep(AGENT_RETRY_INTERVAL_S)
                continue
            raise SpecError("--address", f"the job API at {address} refused the job: {first}") from None


class JobApiLost(Exception):
    """The job API stopped answering for `LOST_API_S` while the job ran (a `ray dashboard` tunnel that
    died, a restarted head): the job itself may still be running."""


def wait_for_job(
    job: Job,
    timeout_s: float | None = None,
    on_output: Callable[[str], None] | None = None,
    poll_s: float = 1.0,
) -> JobOutcome:
    """Polls until the job ends (or `timeout_s` passes: then it is stopped); passes new log text on.

    The job API returns the whole log each time, so it is fetched less often as it grows (at most
    `LOG_BYTES_PER_S` on average: a multi-day job's log is not re-sent every second). A job API that
    stops answering is asked again for `LOST_API_S`, then `JobApiLost`."""
    started = time.monotonic()
    shown, logs, next_logs, failing_since = 0, "", started, None
    while True:
        try:
            status = str(job.client.get_job_status(job.job_id).value)
            if status in TERMINAL or time.monotonic() >= next_logs:
                logs = job.client.get_job_logs(job.job_id)
                next_logs = time.monotonic() + max(poll_s, len(logs) / LOG_BYTES_PER_S)
            failing_since = None
        except Exception as err:  # requests' connection errors, Ray's RuntimeError for an HTTP error
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > LOST_API_S:
                first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
                raise JobApiLost(first) from None
            time.sleep(poll_s)
            continue
        if on_output and len(logs) > shown:
            on_output(logs[shown:])
            shown = len(logs)
        if status in TERMINAL:
            return JobOutcome(job.job_id, status, logs, time.monotonic() - started)
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            job.client.stop_job(job.job_id)
            return JobOutcome(job.job_id, "TIMEOUT", logs, time.monotonic() - started)
        time.sleep(poll_s)


def last_json_document(logs: str) -> Any:
    """The last JSON document a job printed (a `service ... --json` command's answer), or None: its log
    mixes Ray's own lines and the job's stderr with it."""
    lines = logs.splitlines()
    decoder = json.JSONDecoder()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(("{", "[")):
            try:
                return decoder.raw_decode("\n".join(lines[i:]))[0]
            except ValueError:
                continue
    return None
