"""The Decision section's goodput lines: how often to checkpoint, the interruption rate behind it (with
its source), and what checkpointing more often than the optimum would cost."""

from __future__ import annotations

from service.report.decision_records import Goodput
from service.report.render import Block
from service.report.result import RunResult


def _interval(hours: float) -> str:
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.2f} h"


def _paragraph(g: Goodput) -> str:
    return (
        f"Checkpoint every **{g.checkpoint_interval_hours:.2f} h** (Young/Daly optimum "
        f"{g.young_daly_interval_hours:.1f} h for a {g.checkpoint_bytes / 1e9:,.0f} GB "
        f"checkpoint written in {g.checkpoint_write_s:,.0f} s; job MTBF {g.mtbf_hours:,.0f} h); "
        f"expected goodput {g.goodput:.1%}."
    )


def _rate(g: Goodput) -> str:
    gpus = f" on {g.num_gpus:,} GPUs" if g.num_gpus else ""
    return (
        f"Interruption rate {g.interruptions_per_gpu_hour:.3g} per GPU-hour{gpus} (its source: the Goodput "
        "table below); set `goodput.interruptions_per_gpu_hour` to your cluster's own."
    )


def _table(g: Goodput) -> Block | None:
    if len(g.interval_costs) < 2:  # the optimum alone: no shorter interval fits in the run
        return None
    rows = [
        [
            f"{c.label} ({_interval(c.interval_hours)})" if c.extra_vs_optimum == 0.0 else c.label,
            f"{c.wall_hours:,.2f}",
            "—" if c.extra_vs_optimum == 0.0 else f"+{c.extra_vs_optimum:.2%}",
        ]
        for c in g.interval_costs
    ]
    return ("table", ["checkpoint every", "expected wall-clock h", "extra cost over the optimum"], rows)


def goodput_blocks(r: RunResult) -> list[Block]:
    """The checkpoint interval, the rate and its source, and the cost of shorter intervals (same rule:
    W = H·(1 + C/τ + (τ/2 + R + C)/M)); nothing without a goodput record."""
    g = r.goodput
    if g is None:
        return []
    blocks: list[Block] = [("p", _paragraph(g)), ("p", _rate(g))]
    table = _table(g)
    if table is not None:
        blocks.append(table)
    return blocks
