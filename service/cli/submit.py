"""`python -m service submit [--address URL] [--mlflow-uri URI] [--no-wait] [--timeout S] -- COMMAND ...`

Submits COMMAND (e.g. `python -m service search experiments/X.yaml --space search_spaces/Y.yaml`) to
a Ray cluster's job API (RAY_ADDRESS or http://127.0.0.1:8265: the `ray dashboard` tunnel) with this
checkout as its working dir, streams its output, and exits with the job's result: 0 when it
succeeded, 1 when it failed or ran past --timeout (its last log line is repeated on stderr), 2 for bad
input, such as a file the command names that does not exist or a cluster that does not answer (one
line, before submitting), 3 when the job API stopped answering while the job ran (it may still run).
With --json the job's output goes to stderr and stdout is one JSON document (its `output`: the job's own
last JSON document, e.g. of `-- python -m service plan X.yaml --json`).
MLFLOW_TRACKING_URI, SERVICE_SEARCH_DIR and SERVICE_STORAGE_PATH are passed on to the job (see
service/cluster/jobs.py); clusters started with `ray start` use token auth (set RAY_AUTH_MODE=token).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from service.cli.args import positive_float
from service.cluster.jobs import DEFAULT_ADDRESS
from service.spec.errors import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS,
                        help="The job API (default: RAY_ADDRESS, else %(default)s).")  # fmt: skip
    parser.add_argument("--working-dir", default=".", help="Uploaded as the job's working dir (default: .).")
    parser.add_argument("--mlflow-uri", help="MLFLOW_TRACKING_URI for the job (default: this environment's).")
    parser.add_argument("--no-wait", action="store_true", help="Print the job id and return.")
    parser.add_argument("--timeout", type=positive_float, help="Stop the job after this many seconds.")
    parser.add_argument(
        "--json",
        action="store_true",
        help="Stream the job's output on stderr and print one JSON document on stdout: the job's id, "
        "status and wall time, and `output`, the last JSON document it printed.",
    )
    parser.add_argument("job_command", metavar="COMMAND", nargs=argparse.REMAINDER, help="-- COMMAND")


def run(args: argparse.Namespace) -> int:
    from service.cli.stdio import print_json
    from service.cluster.jobs import JobApiLost, last_json_document, submit_job, wait_for_job

    command = args.job_command[1:] if args.job_command[:1] == ["--"] else args.job_command
    env = {"MLFLOW_TRACKING_URI": args.mlflow_uri} if args.mlflow_uri else None
    working_dir = Path(args.working_dir)
    if not working_dir.is_dir():
        raise SpecError("--working-dir", f"{args.working_dir}: not a folder")
    job = submit_job(args.address, command, working_dir=working_dir, env=env)
    print(f"submitted {job.job_id} to {job.address}", file=sys.stderr, flush=True)
    if args.no_wait:
        if args.json:
            print_json({"job_id": job.job_id, "address": job.address})
        else:
            print(job.job_id)
        return 0
    stream = sys.stderr if args.json else sys.stdout  # --json: stdout is the one document below

    def show(text: str) -> None:
        stream.write(text)
        stream.flush()

    try:
        outcome = wait_for_job(job, args.timeout, on_output=show)
    except JobApiLost as lost:
        if args.json:  # the job id of a job that may still run is what a script needs most
            print_json({"job_id": job.job_id, "status": "UNKNOWN", "error": f"lost the job API: {lost}"})
        print(f"error: lost the job API at {job.address} ({lost}); job {job.job_id} may still be running: "
              f"`ray job status {job.job_id}`, `ray job stop {job.job_id}`", file=sys.stderr)  # fmt: skip
        return 3
    print(f"job {outcome.job_id} {outcome.status} after {outcome.wall_s:.0f} s", file=sys.stderr)
    if args.json:
        doc = {"job_id": outcome.job_id, "status": outcome.status, "wall_s": round(outcome.wall_s, 1)}
        print_json({**doc, "output": last_json_document(outcome.logs)})
    if outcome.status == "SUCCEEDED":
        return 0
    if outcome.status == "TIMEOUT":
        print(f"error: stopped after {args.timeout:g} s (--timeout)", file=sys.stderr)
    elif outcome.last_line:  # the job's own last line; a service command's already reads "error: ..."
        print(f"error: {outcome.last_line.removeprefix('error: ')}", file=sys.stderr)
    return 1
