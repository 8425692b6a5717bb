"""`python -m service preflight EXPERIMENT.yaml [--plan selected|LABEL] [--steps N] [--out DIR]
[--storage-path DIR] [--params PARAMS.yaml] [--min-tokens-per-s X] [--max-memory-gib X]
[--min-bandwidth-fraction X] [--min-storage-gb-per-s X] [--message-mib X] [--no-track] [--json]`

The first hour on the cluster, before the long run: N steps of the chosen plan at full scale on Ray
Train (tokens/s, step time, the busiest rank's peak memory), the collectives the plan uses inside a node
and across nodes (bus bandwidth as nccl-tests defines it) and a checkpoint save and load on the
cluster's storage, against thresholds stated before measuring: the estimate's 80 % interval low end,
its memory limit, a fraction of the bus bandwidth the cost model assumed, the goodput model's storage
bandwidth (each overridable below). The last line is the verdict, `GO` or `NO-GO: <reasons>`; exit 0
for GO, 1 for NO-GO, 2 for bad input. What it measured is written to DIR/preflight_run.yaml, a runs
file `python -m service calibrate` reads, and DIR/preflight.json.
"""

from __future__ import annotations

import argparse
import sys

from service.cli.args import finite_float, positive_float, positive_int
from service.spec.units import GIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("experiment", help="Experiment YAML.")
    a("--plan", default="selected", help="'selected' (default) or a plan label.")
    a("--steps", type=positive_int, help="Optimizer steps of the run (default: warm-up steps + 3).")
    a(
        "--out",
        metavar="DIR",
        help="Output folder (default: $SERVICE_STORAGE_PATH/preflight/<experiment> when that is set, "
        "else ray_results/preflight/<experiment>).",
    )
    a("--storage-path", help="The cluster's shared storage for checkpoints and the step log.")
    a("--params", default=None, help="Parameter set for the estimate and bus efficiencies.")
    a("--min-tokens-per-s", type=finite_float, help="Tokens/s floor (default: the 80 %% interval's low end).")
    a("--max-memory-gib", type=positive_float, help="Peak memory per rank ceiling (default: the estimate's).")
    a(
        "--min-bandwidth-fraction",
        type=finite_float,
        help="Floor on measured / assumed bus bandwidth, every collective (default 0.5).",
    )
    a(
        "--min-storage-gb-per-s",
        type=finite_float,
        help="Checkpoint write floor (default: the goodput model's).",
    )
    a("--message-mib", type=positive_float, help="Collective buffer size (default 8 MiB CPU, 256 MiB GPU).")
    a(
        "--compare",
        metavar="PLAN",
        help="A/B: run this plan too for the same steps ('tie': the best on paper among the choice's ties).",
    )
    a("--no-track", action="store_true", help="Do not log the run to MLflow.")
    a("--json", action="store_true", help="Print one JSON document on stdout.")


def run(args: argparse.Namespace) -> int:
    from service.cli.stdio import library_output_to_stderr, print_json
    from service.preflight.first_hour import Preflight, main_line

    overrides = {
        "min_tokens_per_s": args.min_tokens_per_s,
        "max_memory_bytes": args.max_memory_gib * GIB if args.max_memory_gib else None,
        "min_bandwidth_fraction": args.min_bandwidth_fraction,
        "min_storage_gb_per_s": args.min_storage_gb_per_s,
    }
    preflight = Preflight(
        args.experiment,
        args.plan,
        steps=args.steps,
        out_dir=args.out,
        storage_path=args.storage_path,
        params=args.params,
        overrides=overrides,
        message_mib=args.message_mib,
        compare=args.compare,
        track=not args.no_track,
        log=sys.stderr,
    )
    with library_output_to_stderr():
        result = preflight.fit()
    if args.json:
        print_json(result.summary())
    else:
        print(main_line(result))
    return 0 if result.go else 1
