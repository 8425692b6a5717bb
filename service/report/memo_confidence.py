"""The memo's sections on how far to trust the decision: the tie group the choice won and why, the
evidence behind the headline number (software stack, nearest fitted runs), and the scenarios that
can change the choice, with the budget margin."""

from __future__ import annotations

import math

from service.report.render import Block
from service.report.result import RunResult


def ties(r: RunResult) -> list[Block]:
    t = r.ties
    if t is None:
        return []
    shown = t.members[:8]
    more = f" and {len(t.members) - len(shown)} more" if len(t.members) > len(shown) else ""
    out: list[Block] = [
        ("h2", "Ties: what the model cannot tell apart"),
        ("p", t.note),
        ("p", f"The tie group (within ±{math.expm1(t.resolution):.1%}): " + ", ".join(shown) + more + "."),
    ]
    if r.selected_label is not None and r.selected_label != t.members[0]:
        out.append(
            ("p", f"The sensitivity scenarios below then choose {r.selected_label}, the tie group's plan "
             "that stays closest to the best when the network, overheads or memory move.")
        )  # fmt: skip
    return out


def evidence(r: RunResult) -> list[Block]:
    e = r.evidence
    if e is None:
        return []
    return [
        ("h2", "Evidence behind the number"),
        (
            "p",
            f"The chosen plan runs {e.stack} on {e.gpu}; {e.interval_note}. The nearest runs the "
            "parameters were fit on, with the model's error on each when its source was left out of the fit "
            "(predicted / measured − 1: +8 % means the model said 8 % faster than the run measured):",
        ),
        ("ul", e.nearest),
        *(
            [
                (
                    "p",
                    "The nearest published runs no parameter was fit on (recent stacks, mixture-of-"
                    "experts runs: benchmarks/recent_runs_check.py, benchmarks/moe_accuracy.py), each line "
                    "one source's runs of one model and stack, with the shipped parameter set's errors:",
                ),
                ("ul", e.outside_fit),
            ]
            if e.outside_fit
            else []
        ),
    ]


def sensitivity(r: RunResult) -> list[Block]:
    s = r.sensitivity
    if s is None:
        return []
    unit = "dollars" if r.objective == "cost" else "tokens/s"
    rows = [
        [
            sc.name,
            sc.selected_label or "none",
            sc.nominal_status,
            "-" if math.isnan(sc.nominal_regret) else _regret(sc.nominal_regret),
            f"{sc.nominal_value:,.0f}" if sc.nominal_value is not None else "-",
            f"{sc.objective_value:,.0f}" if sc.objective_value is not None else "-",
        ]
        for sc in s.scenarios
    ]
    out: list[Block] = [
        ("h2", "Sensitivity: what would change the choice"),
        (
            "p",
            "Each scenario moves one thing plans depend on differently (the network between nodes, a "
            "per-micro-step overhead, memory, the cost of offload) and ranks every plan again.",
        ),
        (
            "table",
            [
                "scenario",
                "its choice",
                "our choice's status",
                "ours behind its best",
                f"our choice's {unit}",
                f"its choice's {unit}",
            ],
            rows,
        ),
        ("p", f"{s.note[:1].upper()}{s.note[1:]}."),
    ]
    if s.flip:
        out.append(("p", f"**What would flip it:** {s.flip}."))
    if s.budget_margin:
        out.append(("p", f"**Budget margin:** {s.budget_margin}."))
    return out


def confidence_blocks(r: RunResult) -> list[Block]:
    return ties(r) + evidence(r) + sensitivity(r)


def _regret(x: float) -> str:
    return "misses the budget" if not math.isfinite(x) else f"{x:.1%}"
