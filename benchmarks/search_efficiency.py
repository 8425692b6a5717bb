"""How many trials the model-guided search needs to get within 3 % of the full grid's best, vs the grid.

A fixed CPU proxy space of 12 plans (tiny-cpu experiment, 2 workers: ZeRO stage 0-3 × micro-batch
1, 2, 4) is searched twice in one run, both for real on a local Ray cluster:

1. the baseline: the full grid, every plan of the space, in the space's order, unguided (no
   pruning by prediction, no early stopping);
2. the model-guided search as a user runs it: the same plans ordered by the cost model's predicted
   tokens/s, best first, stopping after `--patience` trials without improvement.

It reports the number of guided trials until one measures within 3 % of the grid's best measured
tokens/s, as a fraction of the grid's trial count (goal: <= 25 %), and the same count computed from the
grid's own measurements of the plans in predicted order (free of run-to-run noise), plus the rank
correlation between predicted and measured throughput. Everything is written to
benchmarks/results/search_efficiency.json.

Usage: python benchmarks/search_efficiency.py [--steps 8] [--patience 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXPERIMENT = HERE.parent / "experiments" / "tiny-cpu.yaml"
RESULTS_PATH = HERE / "results" / "search_efficiency.json"
WITHIN = 0.03
GOAL_FRACTION = 0.25
SPACE = {
    "name": "efficiency-12",
    "description": "ZeRO stage x micro-batch on the tiny CPU proxy: 12 plans, all runnable.",
    "metric": "tokens_per_s",
    "params": {"zero_stage": [0, 1, 2, 3], "micro_batch": [1, 2, 4], "tp": [1], "pp": [1], "grad_accum": [1]},
    "search": {"asha": None},
}


def _spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (no ties expected among measured/predicted throughputs)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0] * len(v)
        for rank, i in enumerate(order):
            r[i] = rank
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True))
    return 1 - 6 * d2 / (n * (n * n - 1))


def _rows(result: Any) -> list[dict[str, Any]]:
    return [
        {
            "trial": i + 1,
            "plan": t.key,
            "status": t.status,
            "measured_tokens_per_s": t.measured.get("tokens_per_s"),
            "predicted_tokens_per_s": t.predicted.get("tokens_per_s"),
        }
        for i, t in enumerate(result.trials)
    ]


def _first_within(rows: list[dict[str, Any]], target: float) -> int | None:
    """1-based index of the first trial measuring >= target tokens/s."""
    return next((r["trial"] for r in rows if (r["measured_tokens_per_s"] or 0.0) >= target), None)


def run(steps: int, patience: int, workdir: Path, algorithm: str = "grid") -> dict[str, Any]:
    from service.search import RunConfig, Search, SearchConfig
    from service.search.space import space_from_dict
    from service.spec import load_experiment

    experiment = load_experiment(EXPERIMENT)
    experiment = experiment.model_copy(
        update={
            "tracking": experiment.tracking.model_copy(update={"uri": f"sqlite:///{workdir / 'mlflow.db'}"})
        }
    )
    space = space_from_dict({**SPACE, "search": {**SPACE["search"], "steps": steps}})
    os.environ.pop("MLFLOW_TRACKING_URI", None)

    started = time.monotonic()
    grid = Search(
        experiment,
        space,
        config=SearchConfig(algorithm="grid", guided=False, patience=None),
        run_config=RunConfig(storage_path=workdir, name="grid", progress=True),
    ).fit()
    grid_s = time.monotonic() - started
    started = time.monotonic()
    guided = Search(
        experiment,
        space,
        config=SearchConfig(algorithm="grid", guided=True, patience=patience),
        run_config=RunConfig(storage_path=workdir, name="guided", progress=True),
    ).fit()
    guided_s = time.monotonic() - started

    grid_rows, guided_rows = _rows(grid), _rows(guided)
    ok = [r for r in grid_rows if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["measured_tokens_per_s"])
    target = (1 - WITHIN) * best["measured_tokens_per_s"]
    needed = _first_within(guided_rows, target)
    by_plan = {r["plan"]: r for r in grid_rows}
    predicted_order = sorted(ok, key=lambda r: -r["predicted_tokens_per_s"])
    replay = [{**by_plan[r["plan"]], "trial": i + 1} for i, r in enumerate(predicted_order)]
    needed_on_grid = _first_within(replay, target)
    return {
        "space": SPACE["params"],
        "experiment": str(EXPERIMENT.relative_to(HERE.parent)),
        "steps_per_trial": steps,
        "patience": patience,
        "guided_algorithm": algorithm,
        "grid_trials": len(grid_rows),
        "grid_best": {"plan": best["plan"], "measured_tokens_per_s": best["measured_tokens_per_s"]},
        "within": WITHIN,
        "target_tokens_per_s": target,
        "guided_trials_run": len(guided_rows),
        "guided_trials_to_within": needed,
        "guided_fraction_of_grid": None if needed is None else needed / len(grid_rows),
        "guided_trials_to_within_on_grid_measurements": needed_on_grid,
        "goal_fraction": GOAL_FRACTION,
        "goal_met": needed is not None and needed / len(grid_rows) <= GOAL_FRACTION,
        "spearman_predicted_vs_measured": _spearman(
            [r["predicted_tokens_per_s"] for r in ok], [r["measured_tokens_per_s"] for r in ok]
        ),
        "grid": grid_rows,
        "guided": guided_rows,
        "guided_stopped": guided.stopped_reason,
        "wall_s": {"grid": grid_s, "guided": guided_s},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per trial (2 are warm-up)")
    parser.add_argument("--patience", type=int, default=3, help="guided search: trials without improvement")
    parser.add_argument(
        "--algorithm",
        choices=("grid", "bayes"),
        default="grid",
        help="guided search: model order (grid) or Optuna TPE warm-started by the model",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="search-efficiency-") as tmp:
        report = run(args.steps, args.patience, Path(tmp), args.algorithm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"grid: {report['grid_trials']} trials, best {report['grid_best']['plan']} "
        f"{report['grid_best']['measured_tokens_per_s']:.0f} tokens/s ({report['wall_s']['grid']:.0f} s)"
    )
    needed = report["guided_trials_to_within"]
    print(
        f"guided: {report['guided_trials_run']} trials run; within {WITHIN:.0%} of the grid's best after "
        f"{needed if needed is not None else 'never'} (goal <= {GOAL_FRACTION:.0%} of the grid: "
        f"{'met' if report['goal_met'] else 'not met'}); on the grid's own measurements: "
        f"{report['guided_trials_to_within_on_grid_measurements']}; "
        f"Spearman(predicted, measured) = {report['spearman_predicted_vs_measured']:.2f}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
