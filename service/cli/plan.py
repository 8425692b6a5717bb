"""`python -m service plan EXPERIMENT.yaml [--top K] [--json]`: rank every valid plan, select one.

Prints the selection (memory breakdown, tokens/s, hours, dollars), the top K plans as an aligned
table, and how many candidates lost for each reason; or the same as JSON. Exit 0 when a plan was
selected, 1 when no plan meets the budget (the answer says which constraint binds), 2 on bad input.
Imports neither torch, ray nor deepspeed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, get_args

from service.cli.stdio import print_json
from service.spec.plan import Precision
from service.spec.units import GIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="Experiment YAML (model, cluster, workload, budget).")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="Plans to list (default 10).")
    parser.add_argument("--json", action="store_true", help="Print JSON instead of tables.")
    parser.add_argument(
        "--max-micro-batch",
        type=int,
        default=64,
        metavar="B",
        help="Largest micro-batch tried (powers of two).",
    )
    parser.add_argument(
        "--precision",
        choices=get_args(Precision),
        default="bf16",
        help="Compute precision (default bf16).",
    )
    parser.add_argument("--params", default=None, help="Cost-model parameter set (YAML; default: shipped).")
    parser.add_argument(
        "--prune",
        action="store_true",
        help="Skip the layouts whose lower bound on the step time cannot reach the choice's tie or the top "
        "K: the same choice and top plans, for spaces of millions of plans (MoE on thousands of GPUs).",
    )
    parser.add_argument(
        "--engines",
        default=None,
        metavar="E1,E2",
        help="Engines to search and rank together, comma-separated from deepspeed, fsdp, megatron "
        "(default: the experiment's `engines`, else deepspeed).",
    )


def run(args: argparse.Namespace) -> int:
    from service.planner import Planner
    from service.spec import SpecError

    if args.top < 0:
        raise SpecError("--top", f"must be 0 or more, got {args.top}")
    if args.max_micro_batch < 1:
        raise SpecError("--max-micro-batch", f"must be 1 or more, got {args.max_micro_batch}")
    experiment: Any = args.experiment
    if args.engines is not None:
        experiment = _with_engines(args.experiment, args.engines)
    planner = Planner(
        experiment,
        top_k=args.top,
        max_micro_batch=args.max_micro_batch,
        precision=args.precision,
        params=args.params,
        prune=args.prune,
    )
    result = planner.fit()
    if args.json:
        print_json(result.to_dict())
    else:
        print(render(result))
    return 0 if result.selected is not None else 1


def _with_engines(path: str, engines: str) -> Any:
    """The experiment at `path` with its `engines` replaced; an unknown engine is a one-line error."""
    from service.spec import SpecError, load_experiment
    from service.spec.plan_table import ENGINE_CODES

    names = [e.strip() for e in engines.split(",") if e.strip()]
    unknown = [e for e in names if e not in ENGINE_CODES]
    if unknown or not names:
        allowed = ", ".join(ENGINE_CODES)
        raise SpecError("--engines", f"unknown engine {unknown or engines!r}; allowed: {allowed}")
    return load_experiment(path).model_copy(update={"engines": list(dict.fromkeys(names))})


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` columns left-aligned, the rest right."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def memory_lines(memory: dict[str, float], limit_bytes: float) -> str:
    """Memory per GPU by term, in GiB, as an aligned two-row table."""
    terms = ["params", "grads", "optimizer", "activations", "logits", "buffers", "overhead", "total"]
    cells = [f"{memory[t] / GIB:.2f}" for t in terms] + [f"{limit_bytes / GIB:.2f}"]
    table = format_table([*terms, "limit"], [cells], left=0)
    if memory.get("experts"):
        table += f"\n(of params, grads and optimizer: {memory['experts'] / GIB:.2f} GiB the routed experts')"
    if memory.get("cpu_offload"):
        table += f"\n(plus {memory['cpu_offload'] / GIB:.2f} GiB per GPU offloaded to host memory)"
    return table


def span(interval: tuple[float, float], fmt: str = ",.0f", unit: str = "", label: str = "") -> str:
    """An interval as `label low-high`, or "no interval" when the parameter set has none (low = high)."""
    low, high = interval
    if low == high:
        return "no interval"
    return f"{label}{unit}{low:{fmt}}-{unit}{high:{fmt}}"


def _plan_row(entry: Any) -> list[str]:
    est = entry.estimate
    mem = est.memory_per_gpu_bytes
    return [
        str(entry.rank) if entry.rank is not None else "-",
        entry.plan.short(),
        entry.status,
        f"{mem.total / GIB:.1f}",
        f"{est.step_time_s:.2f}",
        f"{est.tokens_per_s:,.0f}",
        span(est.tokens_per_s_interval),
        f"{est.tokens_per_s_per_gpu:,.0f}",
        f"{est.mfu:.1%}",
        f"{est.hours:,.2f}",
        f"{est.dollars:,.0f}",
    ]


PLAN_HEADERS = [
    "#",
    "plan",
    "status",
    "mem GiB",
    "step s",
    "tokens/s",
    "80 % interval",
    "tok/s/GPU",
    "MFU",
    "hours",
    "dollars",
]


def _describe(entry: Any, title: str) -> list[str]:
    est = entry.estimate
    return [
        f"{title}: {entry.plan.short()}",
        f"  {est.tokens_per_s:,.0f} tokens/s ({span(est.tokens_per_s_interval, label='80 % interval ')}; "
        f"{est.tokens_per_s_per_gpu:,.0f} per GPU), MFU {est.mfu:.1%}, step {est.step_time_s:.2f} s",
        f"  {est.hours:,.1f} h ({span(est.hours_interval, ',.1f')}), "
        f"${est.dollars:,.0f} ({span(est.dollars_interval, ',.0f', '$')}), "
        "interruptions, checkpoints and restarts included",
        f"  parameter set {est.params.name!r}, fit on {len(est.params.fit_on)} sources "
        f"({est.params.fit_runs} runs); interval: {est.params.interval}",
        "  memory per GPU (GiB):",
        *(
            "    " + line
            for line in memory_lines(
                est.memory_per_gpu_bytes.model_dump(), est.memory_limit_bytes
            ).splitlines()
        ),
    ]


def render(result: Any) -> str:
    """The human-readable answer: budget, selection (or why none), top plans, rejected counts."""
    b = result.budget
    limits = ", ".join(
        x
        for x in (
            f"max ${b.max_dollars:,.0f}" if b.max_dollars is not None else "",
            f"max {b.max_hours:g} h" if b.max_hours is not None else "",
            f"{b.memory_headroom:.0%} memory headroom",
        )
        if x
    )
    out = [
        f"{result.experiment}: objective {result.objective}; {limits}",
        f"{result.candidates:,} candidate plans, {result.plans_evaluated:,} valid plans scored and ranked "
        f"in {result.elapsed_s * 1e3:.0f} ms",
        "",
        result.message,
    ]
    if result.selected is not None:
        out += ["", *_describe(result.selected, "selected")]
    elif result.fallback is not None:
        out += ["", *_describe(result.fallback, "fallback")]
    if result.ranked:
        out += ["", format_table(PLAN_HEADERS, [_plan_row(r) for r in result.ranked], left=3)]
    counts = [[reason, f"{n:,}"] for reason, n in result.rejected_counts.items()]
    out += ["", format_table(["rejected because", "plans"], counts)]
    return "\n".join(out)
