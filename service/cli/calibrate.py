"""`python -m service calibrate RUNS.yaml [--out PARAMS.yaml] [--json]`: fit the cost model's parameters
on measured runs, with the leave-one-source-out error per source and the fitted values with their bands.

RUNS is a runs file (YAML in benchmarks/published/measurements.yaml's format, or CSV; see
service/calibrate/runs.py). `--out` writes the fitted set; pass it to `estimate`/`plan` with `--params`.
Imports neither torch, ray nor deepspeed.
"""

from __future__ import annotations

import argparse
from typing import Any

from service.cli.stdio import print_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("runs", help="Runs file: YAML (published-set format) or CSV.")
    a("--out", default=None, help="Write the fitted parameter set here (YAML).")
    a("--name", default=None, help="Name of the fitted set (default: the runs file's stem).")
    a("--prior", default=None, help="Start from this parameter set (default: the analytical prior).")
    a(
        "--profile",
        action="append",
        default=[],
        help="GPU operator profile (python -m service profile); runs on its GPU type use the profiled spec.",
    )
    a("--no-crossval", action="store_true", help="Fit only; skip leave-one-source-out (no intervals).")
    a(
        "--fit",
        default=None,
        help="Comma-separated parameters to fit (default: every time parameter but the collective "
        "latency scale; 'all' for every time parameter).",
    )
    a("--json", action="store_true", help="Print JSON instead of a report.")


def render(report: dict[str, Any]) -> str:
    lines = [f"parameter set {report['params']['name']!r}, fit on {report['params']['fit_runs']} runs"]
    lines.append(f"{'parameter':28s} {'value':>9s}  band")
    for k, b in report["values"].items():
        edge = f"  (at {report['at_bounds'][k]} bound)" if k in report["at_bounds"] else ""
        lines.append(f"{k:28s} {b['value']:9.4g}  [{b['low']:g}, {b['high']:g}] {b['unit']}{edge}")
    cv = report.get("crossval")
    if cv:
        lines.append(
            f"\nleave-one-source-out: MAPE {cv['mape']:.1%}, 80 % interval coverage {cv['coverage_80']:.0%}"
        )
        for s, v in cv["per_source"].items():
            lines.append(f"  {s:32s} n={v['n']:3d}  MAPE {v['mape']:6.1%}  coverage {v['coverage_80']:4.0%}")
    if report.get("interval_withheld"):
        lines.append(f"\n{report['interval_withheld']}")
    if report.get("crossval_skipped"):
        lines.append(f"\nleave-one-source-out skipped: {report['crossval_skipped']}")
    lines.append(f"\ninterval: {report['params']['interval']}")
    return "\n".join(lines)


def _names(text: str | None) -> tuple[str, ...]:
    from service.spec import SpecError
    from service.spec.param_bands import MEMORY_PARAMS, PUBLISHED_FIT_PARAMS, TIME_PARAMS, default_bands

    if text is None:
        return PUBLISHED_FIT_PARAMS
    if text == "all":
        return TIME_PARAMS
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in default_bands()]
    if unknown or not names:
        raise SpecError(
            "--fit", f"unknown parameter(s) {unknown}; allowed: all, {', '.join(default_bands())}"
        )
    memory = [n for n in names if n in MEMORY_PARAMS]
    if memory:  # fitting one would return the prior unchanged, under its own name
        raise SpecError(
            "--fit",
            f"{', '.join(memory)}: memory parameters fit on measured activations, which a runs file does not "
            f"carry (`run` fits them on its proxies); allowed: all, {', '.join(TIME_PARAMS)}",
        )
    return names


def _load_runs(path: str) -> Any:
    """`load_runs`, with a file that is not UTF-8 text (the CSV reader decodes it itself) as one line."""
    from service.calibrate import load_runs
    from service.spec.experiment import read_text

    read_text(path, "runs")  # missing, a folder, binary or UTF-16: the one-line error naming the file
    return load_runs(path)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from service.calibrate.crossval import calibrate, calibration_report
    from service.calibrate.runs import with_profiles
    from service.cli.args import output_path
    from service.profile import load_profile
    from service.spec.params import ModelParams, load_params, save_params

    # The quick checks first: the runs file's rows are planned one by one, and the fit takes a while.
    out = output_path("--out", args.out) if args.out is not None else None
    fit = _names(args.fit)
    prior = load_params(args.prior) if args.prior else ModelParams()
    for path in args.profile:
        load_profile(path)
    runs = with_profiles(_load_runs(args.runs), args.profile)
    note = f"fit by `python -m service calibrate {args.runs}`"
    name = args.name or Path(args.runs).stem
    params, cv = calibrate(runs, prior, fit, name=name, note=note, crossval=not args.no_crossval)
    report = calibration_report(params, cv, crossval_asked=not args.no_crossval)
    if out is not None:
        report["written"] = str(save_params(params, out))
    if args.json:
        print_json(report)
    else:
        print(render(report))
    return 0
