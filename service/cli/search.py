"""`python -m service search EXPERIMENT.yaml --space SPACE.yaml [--algorithm grid|random|bayes]
[--max-trials N] [--pending-timeout S] [--resume PATH] [--json]`

Runs a search on the local Ray (or RAY_ADDRESS) with a progress bar on stderr, records it in MLflow,
prints the trials, the selected plan, the pruned plans and the MLflow run (or, with --json, one JSON
document on stdout: best, trials, pruned, mlflow_run_id). Exit 0 when a plan was selected, 1 when no
trial ran to the end, 2 for bad input (one line), 130 when it was stopped (Ctrl-C; --resume goes on).
Searches are kept in $SERVICE_SEARCH_DIR (default <repo>/ray_results/search); the folder a search prints
is what --resume takes.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from service.cli.args import finite_float
from service.spec.errors import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", nargs="?", help="Experiment YAML (optional with --resume).")
    parser.add_argument("--space", help="Search-space YAML (see search_spaces/).")
    parser.add_argument("--algorithm", choices=("grid", "random", "bayes"), help="Default: the space's.")
    parser.add_argument("--max-trials", type=int, help="Most trials to launch. Default: the space's.")
    parser.add_argument(
        "--pending-timeout",
        type=finite_float,
        metavar="S",
        help="A trial whose workers are not placed within S seconds is recorded as unschedulable and "
        "the search goes on. Default: the space's (600).",
    )
    parser.add_argument("--resume", metavar="PATH", help="Continue the search saved in PATH (its folder).")
    parser.add_argument("--json", action="store_true", help="Print one JSON document on stdout.")


def _make_search(args: argparse.Namespace) -> Any:
    from service.search.config import RunConfig, SearchConfig
    from service.search.driver import Search
    from service.search.space import load_space
    from service.spec.experiment import load_experiment

    if args.max_trials is not None and args.max_trials <= 0:
        raise SpecError("--max-trials", f"must be positive, got {args.max_trials}")
    if args.pending_timeout is not None and args.pending_timeout <= 0:
        raise SpecError("--pending-timeout", f"must be positive, got {args.pending_timeout:g}")
    if args.resume:
        if args.algorithm or args.max_trials or args.pending_timeout:
            raise SpecError(
                "--resume",
                "a resumed search keeps its algorithm, max trials and pending timeout; drop those flags",
            )
        search = Search.restore(args.resume, progress=True)
        if args.experiment and load_experiment(args.experiment) != search.experiment:
            raise SpecError(
                "--resume", f"{args.experiment} is not the experiment the search in {args.resume} ran"
            )
        if args.space and load_space(args.space) != search.space:
            raise SpecError("--resume", f"{args.space} is not the space the search in {args.resume} ran")
        return search
    if not args.experiment:
        raise SpecError("experiment", "give the experiment YAML (or --resume PATH)")
    if not args.space:
        raise SpecError("--space", "give the search-space YAML (see search_spaces/)")
    experiment, space = load_experiment(args.experiment), load_space(args.space)
    config = SearchConfig(
        algorithm=args.algorithm, max_trials=args.max_trials, pending_timeout_s=args.pending_timeout
    )
    return Search(experiment, space, config=config, run_config=RunConfig(progress=True))


def _fmt(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if value is None else f"{value / scale:,.{digits}f}"


def _report(result: Any) -> str:
    """The human-readable summary: trials, best plan, pruned plans, where the records are."""
    lines = [f"{'trial':<9} {'plan':<42} {'status':<13} {'tokens/s':>10} {'predicted':>10}  reason"]
    for t in result.trials:
        lines.append(
            f"{t.trial_id:<9} {t.key:<42} {t.status:<13} {_fmt(t.measured.get('tokens_per_s')):>10} "
            f"{_fmt(t.predicted.get('tokens_per_s')):>10}  {t.reason[:80]}"
        )
    best = result.best
    if best is None:
        lines.append("no trial ran to the end: nothing selected")
    else:
        lines.append(f"best: {best.key} ({result.metric} {_fmt(best.measured.get(result.metric), digits=1)})")
    kinds: dict[str, int] = {}
    for p in result.pruned:
        kinds[p.kind] = kinds.get(p.kind, 0) + 1
    lines.append(f"pruned: {len(result.pruned)}" + (f" ({kinds})" if kinds else ""))
    if result.num_unschedulable:
        lines.append(
            f"unschedulable: {result.num_unschedulable} trials whose workers the cluster did not place in "
            "time (too small or busy; --pending-timeout waits longer)"
        )
    lines.append(f"stopped: {result.stopped_reason}")
    tracking = result.tracking
    where = f"{tracking.get('uri')} (experiment {tracking.get('experiment')})"
    lines.append(f"mlflow: run {result.mlflow_run_id} in {where}")
    if tracking.get("pending_records"):
        lines.append(
            f"tracking store unreachable ({tracking.get('last_error')}): {tracking['pending_records']} "
            f"records kept in {tracking['pending_file']}; written at the next search once the store is back"
        )
    lines.append(f"resume or inspect: {result.path}")
    if result.copied_to:
        lines.append(f"copied to {result.copied_to}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from service.cli.stdio import library_output_to_stderr, print_json

    search = _make_search(args)
    with library_output_to_stderr():  # Ray, Tune and MLflow print on stdout; --json must parse
        result = search.fit()
    if args.json:
        print_json(result.to_dict(), default=str)
    else:
        print(_report(result))
    if result.interrupted:  # as a shell reports a command stopped by Ctrl-C
        print(f"error: {result.stopped_reason}", file=sys.stderr)
        return 130
    return 0 if result.best is not None else 1
