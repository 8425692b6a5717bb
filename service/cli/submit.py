"""`python -m service submit [--address URL] [--mlflow-uri URI] [--no-wait] [--timeout S] -- COMMAND ...`

Submits COMMAND (e.g. `python -m service search experiments/X.yaml --space search_spaces/Y.yaml`) to
a Ray cluster's job API (RAY_ADDRESS or http://127.0.0.1:8265: the `ray dashboard` tunnel) with this
checkout as its working dir, streams its output, and exits with the job's result: 0 when it
succeeded, 1 when it failed (its last log line is repeated on stderr), 2 for bad input, such as a file
the command names that does not exist or a cluster that does not answer (one line, before submitting).
MLFLOW_TRACKING_URI, SERVICE_SEARCH_DIR and SERVICE_STORAGE_PATH are passed on to the job (see
service/cluster/jobs.py); clusters started with `ray start` use token auth (set RAY_AUTH_MODE=token).
"""

from __future__ import annotations

import argparse
import os
import sys

from service.cli.args import positive_float
from service.cluster.jobs import DEFAULT_ADDRESS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS,
                        help="The job API (default: RAY_ADDRESS, else %(default)s).")  # fmt: skip
    parser.add_argument("--working-dir", default=".", help="Uploaded as the job's working dir (default: .).")
    parser.add_argument("--mlflow-uri", help="MLFLOW_TRACKING_URI for the job (default: this environment's).")
    parser.add_argument("--no-wait", action="store_true", help="Print the job id and return.")
    parser.add_argument("--timeout", type=positive_float, help="Stop the job after this many seconds.")
    parser.add_argument("job_command", metavar="COMMAND", nargs=argparse.REMAINDER, help="-- COMMAND")


def run(args: argparse.Namespace) -> int:
    from service.cluster.jobs import submit_job, wait_for_job

    command = args.job_command[1:] if args.job_command[:1] == ["--"] else args.job_command
    env = {"MLFLOW_TRACKING_URI": args.mlflow_uri} if args.mlflow_uri else None
    job = submit_job(args.address, command, working_dir=args.working_dir, env=env)
    print(f"submitted {job.job_id} to {job.address}", file=sys.stderr, flush=True)
    if args.no_wait:
        print(job.job_id)
        return 0

    def show(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    outcome = wait_for_job(job, args.timeout, on_output=show)
    print(f"job {outcome.job_id} {outcome.status} after {outcome.wall_s:.0f} s", file=sys.stderr)
    if outcome.status == "SUCCEEDED":
        return 0
    if outcome.last_line:  # the job's own last line; a service command's already reads "error: ..."
        print(f"error: {outcome.last_line.removeprefix('error: ')}", file=sys.stderr)
    return 1
