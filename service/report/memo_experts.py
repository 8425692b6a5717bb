"""The memo's sections on a choice beyond one engine's plans: a mixture-of-experts model's expert layout
(why this EP, what its all-to-all costs, how the choice moves with imbalance) and the best plan of the
listed engines `run` does not launch."""

from __future__ import annotations

from service.report.formats import fmt_dollars, fmt_hours, fmt_tokens
from service.report.render import Block
from service.report.result import RunResult


def other_engines(r: RunResult) -> list[Block]:
    """The best plan of the listed engines `run` does not launch, named beside the choice."""
    o = r.other_engines
    if o is None:
        return []
    names = ", ".join(o.engines)
    if o.label is None or o.tokens_per_s is None or o.hours is None or o.dollars is None:
        none = f"**Other engines:** the experiment also lists {names}; no plan of theirs meets the budget."
        return [("p", none)]
    ratio = f", {o.over_chosen:.2f}× the chosen plan's" if o.over_chosen else ""
    return [
        (
            "p",
            f"**Other engines:** the experiment also lists {names}, which `run` neither proves on proxies "
            f"nor launches. The model's best plan of theirs, **{o.label}**, would train at "
            f"{fmt_tokens(o.tokens_per_s)} tokens/s{ratio}, in {fmt_hours(o.hours)} h for "
            f"{fmt_dollars(o.dollars)}: unmeasured here, a preflight on the cluster is what would justify "
            "switching to it.",
        )
    ]


def _faster_families(r: RunResult) -> list[Block]:
    """Why the choice is not the fastest EP family's best plan on paper, where it is not."""
    x, sel = r.experts, r.selected
    if x is None or sel is None:
        return []
    faster = [f for f in x.families if f.tokens_per_s > sel.tokens_per_s.value and f.label != sel.label]
    if not faster:
        return []
    ties = set(r.ties.members) if r.ties else set()
    # A faster plan of the choice's own EP degree is another plan of that degree, not the choice.
    degree = {f.label: f"{f.ep} (another plan of the choice's own degree)" if f.ep == x.ep else str(f.ep)
              for f in faster}  # fmt: skip
    tied = [degree[f.label] for f in faster if f.label in ties]
    lost = [degree[f.label] for f in faster if f.label not in ties]
    out: list[Block] = []
    if tied:
        out.append(
            (
                "p",
                f"The best plans of EP {', '.join(tied)} are faster on paper than the choice but lie within "
                "the model's resolution of it; that tie went to the lowest-risk plan (Ties, below).",
            )
        )
    if lost:
        out.append(
            (
                "p",
                f"The best plans of EP {', '.join(lost)} are faster on paper than the choice and lost for "
                "the reasons their rows give under Alternatives.",
            )
        )
    return out


def experts(r: RunResult) -> list[Block]:
    """Why this expert-parallel degree, what its all-to-all costs, how the choice moves with imbalance."""
    x = r.experts
    if x is None:
        return []
    layout = f"EP {x.ep}" + (f" with expert TP {x.expert_tp}" if x.expert_tp > 1 else "")
    rows = [
        [
            str(f.ep),
            f.label,
            fmt_tokens(f.tokens_per_s),
            f"{f.all_to_all_share:.0%}",
            f"{f.host_wait_share:.0%}",
        ]
        for f in x.families
    ]
    waits = (
        f", and its MoE blocks wait {x.host_wait_share:.0%} of it for the host (their GPU work per "
        "micro-batch is shorter than the framework's host time for it)"
        if x.host_wait_share >= 0.005
        else ""
    )
    cases = [
        [
            f"{c.imbalance:g}",
            c.selected_label or "no plan meets the budget",
            fmt_tokens(c.chosen_tokens_per_s),
        ]
        for c in x.imbalance
    ]
    return [
        ("h2", "Expert parallelism"),
        (
            "p",
            f"The choice splits each MoE block's experts {layout}; its dispatch and combine all-to-alls take "
            f"{x.all_to_all_share:.0%} of the step after overlap{waits}. Router: {x.router}; the busiest "
            f"expert is assumed {x.load_imbalance:g}× its balanced share. The best plan of each EP degree "
            "that meets the budget:",
        ),
        ("table", ["EP", "best plan", "tokens/s", "all-to-all", "host wait"], rows),
        *_faster_families(r),
        ("p", "The same plans re-scored at other load imbalances (the choice's own speed beside):"),
        ("table", ["imbalance", "choice there", "this choice's tokens/s"], cases),
    ]
