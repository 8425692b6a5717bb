"""`python -m service run EXPERIMENT.yaml [--json] [--out DIR] [--params PARAMS.yaml]`

The main job: ranks every plan, validates the competitive ones on proxy runs (Ray Tune, recorded in
MLflow), calibrates the memory terms on them, selects under the budget with goodput and ±20 %
sensitivity, and writes the production DeepSpeed config, the launch command and the design memo.
Human mode prints the decision, where the memo is and how to open the MLflow UI; --json prints one
JSON document on stdout. A run killed mid-way and started again with the same --out continues its
proxy search (finished proxy trials are not run again). Exit 0 when a plan was selected, 1 when
none meets the budget, 2 for bad input.
"""

from __future__ import annotations

import argparse
from typing import Any

from service.spec.errors import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="Experiment YAML (see experiments/).")
    parser.add_argument("--json", action="store_true", help="Print one JSON document on stdout.")
    parser.add_argument("--out", metavar="DIR", help="Run folder (default: ray_results/run/<experiment>).")
    parser.add_argument(
        "--params", metavar="PARAMS.yaml", help="Cost-model parameter set (default: shipped)."
    )
    parser.add_argument("--max-proxies", type=int, default=None, help="Most proxy plans to run (default 4).")
    parser.add_argument("--no-proxies", action="store_true", help="Plan and write the memo without proxies.")


def summary(result: Any) -> str:
    """What a person needs after a run: the decision, its numbers, where the memo and records are."""
    lines = [result.message]
    p = result.predicted
    if p is not None:
        # Memory's band is the rule under the memo's Extrapolation distance, not a checked 80 % interval.
        for v, label, unit, scale, band in (
            (p.tokens_per_s, "throughput", "tokens/s", 1.0, "80 %"),
            (p.hours, "time", "h", 1.0, "80 %"),
            (p.dollars, "cost", "$", 1.0, "80 %"),
            (p.memory_per_gpu_bytes, "memory per GPU", "GiB", 2.0**30, "range"),
        ):
            lo, hi = v.interval
            lines.append(
                f"  {label:<22} {v.value / scale:>12,.2f} {unit:<9} "
                f"{band}: {lo / scale:,.2f}–{hi / scale:,.2f} [{v.tag}]"
            )
    fallback = result.memory_fallback
    if fallback is not None:
        mem = fallback.memory_per_gpu_bytes
        lines.append(
            f"  plan B if memory runs out: {fallback.label}, {mem.value / 2.0**30:.1f} GiB "
            f"(range {mem.low / 2.0**30:.1f}–{mem.high / 2.0**30:.1f}), {fallback.hours.value:.2f} h, "
            f"${fallback.dollars.value:,.0f}"
        )
    err = result.proxy_validation_error.activation_bytes_per_rank
    if result.proxy_validation_error.n:
        lines.append(
            f"proxies: {result.proxy_validation_error.n} ran; activation memory error "
            f"{_pct(err.prior)} prior → {_pct(err.calibrated)} calibrated "
            f"({_pct(err.out_of_sample)} leave-one-out)"
        )
    lines.append(f"memo: {result.memo_paths.get('html')} (and {result.memo_paths.get('markdown')})")
    if result.ds_config_path:
        lines.append(f"DeepSpeed config: {result.ds_config_path}")
        lines.append(f"launch: {result.launch_command}")
        if result.deepspeed_command and result.deepspeed_command != result.launch_command:
            lines.append(f"  or with your own training script: {result.deepspeed_command}")
    if result.tracking_uri:
        from service.tracking.uri import ui_hint

        lines.append(f"MLflow: parent run {result.mlflow_run_id}; see it with")
        lines.append(f"  {ui_hint(result.tracking_uri)}")
    if result.copied_to:
        lines.append(f"outputs copied to {result.copied_to}")
    lines.append(f"rebuild the memo: python -m service report {result.out_dir}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def run(args: argparse.Namespace) -> int:
    from service.cli.args import output_path
    from service.cli.stdio import library_output_to_stderr, print_json
    from service.design.job import DEFAULT_MAX_PROXIES, Run

    if args.max_proxies is not None and args.max_proxies < 0:
        raise SpecError("--max-proxies", f"must be 0 or more, got {args.max_proxies}")
    if args.max_proxies and args.no_proxies:  # one of them would be dropped without a word
        raise SpecError("--max-proxies", f"{args.max_proxies} proxies and --no-proxies: give one of them")
    if args.out is not None:
        output_path("--out", args.out, folder=True)
    try:
        job = Run(
            args.experiment,
            params=args.params,
            storage_path=args.out,
            max_proxies=DEFAULT_MAX_PROXIES if args.max_proxies is None else args.max_proxies,
            run_proxies=not args.no_proxies,
            progress=not args.json,
        )
    except SpecError as err:
        if err.field != "storage_path":
            raise
        raise SpecError("--out", err.message) from None
    with library_output_to_stderr():  # Ray, Tune and MLflow print on stdout; --json must parse
        result = job.fit()
    if args.json:
        print_json(result.to_json(), indent=1, default=str)
    else:
        print(summary(result))
    return 0 if result.selected_plan is not None else 1
