"""The fitted runs nearest a plan, with how far off the model was on each out of sample: the evidence
a reader weighs beside a number ("nearest published: IBM Llama-2-13B FSDP on H100, predicted +3.4 %");
and the nearest published runs kept outside the fit (`published_checks`: recent stacks and
mixture-of-experts runs no parameter was fit on, with the shipped set's error on each).

Nearness, in this order of weight: the same software stack (service/spec/stack.py), the same GPU
type, a model of similar size, a similar GPU count. The distance is a stated sum, not a fit:
1 for another stack + 0.5 for another GPU + 0.25 per doubling of model size + 0.1 per doubling of
GPUs apart.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from service.spec.params import FitRun, ModelParams

# Written by benchmarks/recent_runs_check.py and benchmarks/moe_accuracy.py, one file each.
CHECKS_DIR = Path(__file__).resolve().parents[1] / "catalog" / "checks"

STACK_WEIGHT = 1.0
GPU_WEIGHT = 0.5
SIZE_WEIGHT = 0.25  # per doubling of parameters
GPUS_WEIGHT = 0.1  # per doubling of GPU count


def distance(run: FitRun, stack: str, gpu: str, params_b: float, num_gpus: int) -> float:
    return (
        STACK_WEIGHT * (run.stack != stack)
        + GPU_WEIGHT * (run.gpu != gpu)
        + SIZE_WEIGHT * abs(math.log2(max(run.params_b, 1e-3) / max(params_b, 1e-3)))
        + GPUS_WEIGHT * abs(math.log2(run.num_gpus / num_gpus))
    )


def nearest_runs(
    params: ModelParams, stack: str, gpu: str, params_b: float, num_gpus: int, k: int = 3
) -> list[FitRun]:
    """The `k` fitted runs nearest (stack, gpu, model size, GPU count), nearest first, and the nearest
    run of the same engine when none of those is (its own engine's evidence, however old)."""
    return nearest(params.runs, stack, gpu, params_b, num_gpus, k)


def nearest(
    runs: Sequence[FitRun], stack: str, gpu: str, params_b: float, num_gpus: int, k: int
) -> list[FitRun]:
    """`nearest_runs` over any list of runs."""
    ranked = sorted(runs, key=lambda r: distance(r, stack, gpu, params_b, num_gpus))
    top = ranked[:k]
    engine = stack.split()[0]
    if not any(r.stack.split()[0] == engine for r in top):
        top += [r for r in ranked if r.stack.split()[0] == engine][:1]
    return top


@cache
def published_checks(folder: Path = CHECKS_DIR) -> tuple[FitRun, ...]:
    """Every published run scored outside the fit (`folder`/*.yaml, each `{"params": ..., "runs": [...]}`),
    its `error` the shipped parameter set's predicted / measured − 1."""
    runs: list[FitRun] = []
    for path in sorted(folder.glob("*.yaml")):
        runs += [FitRun.model_validate(r) for r in yaml.safe_load(path.read_text())["runs"]]
    return tuple(runs)


def write_checks(path: Path, params_name: str, note: str, runs: Sequence[FitRun]) -> None:
    """Writes a `published_checks` file: `runs` scored by the parameter set `params_name`."""
    data = {"note": note, "params": params_name, "runs": [r.model_dump() for r in runs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=110))


def add_checks_option(parser: argparse.ArgumentParser, file_name: str) -> None:
    """A benchmark's `--checks PATH` option (default: `file_name` in the shipped checks folder)."""
    parser.add_argument(
        "--checks",
        default=str(CHECKS_DIR / file_name),
        help="where the scored rows go for the memo's evidence (written only with the shipped parameters)",
    )


def save_checks(path: str, params_path: str | None, result: dict[str, Any], note: str) -> None:
    """Writes a benchmark's scored `result["rows"]` as a checks file, when they were scored with the
    shipped parameter set (`params_path` None): the memo quotes the shipped set's errors only."""
    if params_path is None:
        write_checks(Path(path), str(result["params"]), note, [check_run(r) for r in result["rows"]])


def check_run(row: dict[str, object]) -> FitRun:
    """A benchmark's scored row (id, source, model, params_b, gpu, num_gpus, stack, label, error,
    seq_len) as a `published_checks` entry."""
    return FitRun.model_validate(
        {**{k: row[k] for k in FitRun.model_fields if k != "plan"}, "plan": row["label"]}
    )


def nearest_checks(
    stack: str, gpu: str, params_b: float, num_gpus: int, k: int = 2
) -> list[tuple[FitRun, ...]]:
    """The `k` groups of published runs kept outside the fit nearest the plan (a group: one source's
    runs of one model and stack on one GPU type, which differ only in what the distance does not see,
    such as sequence length), nearest first as `nearest_runs` ranks runs; and the nearest group on the
    plan's GPU type when none of those is (what recent runs on that GPU say)."""
    groups: dict[tuple[str, str, str, str], list[FitRun]] = {}
    for r in published_checks():
        groups.setdefault((r.source, r.model, r.stack, r.gpu), []).append(r)

    def far(group: list[FitRun]) -> float:
        return min(distance(r, stack, gpu, params_b, num_gpus) for r in group)

    ranked = sorted(groups.values(), key=far)
    top = ranked[:k]
    if not any(g[0].gpu == gpu for g in top):
        top += [g for g in ranked if g[0].gpu == gpu][:1]
    return [tuple(g) for g in top]


def describe_checks(group: tuple[FitRun, ...]) -> str:
    """One line for a group of runs kept outside the fit: what ran, and the shipped set's error on it
    (its range and median over the group's runs)."""
    first = group[0]
    if len(group) == 1:
        return describe(first)
    errors = sorted(r.error for r in group)
    span = _span(sorted({r.num_gpus for r in group}))
    seqs = sorted({r.seq_len for r in group if r.seq_len})
    tokens = f" at {_span([_k(x) for x in seqs])} tokens" if seqs else ""
    median = statistics.median(errors)
    return (
        f"{first.source}: {len(group)} runs of {first.model} ({first.params_b:.0f}B), {first.stack} on "
        f"{span} × {first.gpu}{tokens}, predicted {errors[0]:+.1%} to {errors[-1]:+.1%} "
        f"(median {median:+.1%})"
    )


def _span(values: Sequence[object]) -> str:
    return f"{values[0]}" if len(values) == 1 or values[0] == values[-1] else f"{values[0]}–{values[-1]}"


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def describe(run: FitRun) -> str:
    """One line: what ran, and the model's out-of-sample error on it."""
    return (
        f"{run.source}: {run.model} ({run.params_b:.0f}B), {run.stack} on {run.num_gpus} × {run.gpu} "
        f"({run.plan}), predicted {run.error:+.1%}"
    )
