"""The memo's charts, drawn from a `RunResult` alone (PNG files; the HTML inlines them as base64). The
numbers come from service/report/charts_data.py, so they are tested apart from the drawing.

- hours and dollars of the best plan of every strategy family, 80 % intervals, the budget's limits,
  the selected plan marked (`families`);
- memory per GPU of every plan the memo shows, stacked by term, the total and its 80 % interval
  written on each bar, the limit and the device memory (`memory`);
- cost against throughput of every plan that fits, Pareto front drawn, the selected plan marked;
- what the proxies check: that each layout builds and steps, and the memory terms per rank, predicted
  against measured (never speed, when they ran on CPU) (`proxies`).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from service.report.charts_data import (
    MIB,
    PROXY_TERMS,
    TERMS,
    FamilyChart,
    MemoryChart,
    family_bars,
    memory_bars,
    proxy_text,
)
from service.report.result import Interval, RunResult

SELECTED_COLOR = "tab:red"
OTHER_COLOR = "tab:blue"
TERM_COLORS = {t: f"C{i}" for i, t in enumerate(TERMS)}  # the default cycle: tab10
WRAP = 130  # characters per line of a figure's footnote


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _gib(x: float, like: float | None = None) -> str:
    """GiB with about three significant digits (of `like`, so an interval's ends read alike)."""
    ref = abs(x if like is None else like)
    return f"{x:,.{0 if ref >= 100 else 1 if ref >= 10 else 2 if ref >= 1 else 3}f}"


def _size(gib: float) -> str:
    return f"{_gib(gib)} GiB" if gib >= 1 else f"{gib * 1024:,.1f} MiB"


def _bold_selected(ax: Any, selected: list[bool]) -> None:
    for tick, sel in zip(ax.get_yticklabels(), selected, strict=True):
        if sel:
            tick.set_fontweight("bold")
            tick.set_color(SELECTED_COLOR)


# -- hours and dollars per family ------------------------------------------------------------------------


def _scaled(iv: Interval, k: float) -> Interval:
    return iv.model_copy(update={"value": iv.value * k, "low": iv.low * k, "high": iv.high * k})


def _interval_panel(
    ax: Any, ivs: list[Interval], selected: list[bool], fmt: str, limit: float | None, limit_name: str
) -> None:
    y = range(len(ivs))
    vals = [iv.value for iv in ivs]
    err = [[iv.value - iv.low for iv in ivs], [iv.high - iv.value for iv in ivs]]
    colors = [SELECTED_COLOR if s else OTHER_COLOR for s in selected]
    ax.barh(y, vals, color=colors, alpha=0.75, height=0.6)
    ax.errorbar(vals, y, xerr=err, fmt="none", ecolor="black", capsize=4, lw=1.2, label="80 % interval")
    right = max([iv.high for iv in ivs] + [limit or 0.0]) * 1.55 or 1.0
    for i, iv in enumerate(ivs):
        text = fmt.format(iv.value) + f"  ({fmt.format(iv.low)}–{fmt.format(iv.high)})"
        ax.text(iv.high + right * 0.015, i, text, va="center", fontsize=8)
    if limit is not None:
        ax.axvline(limit, color="black", linestyle="--", lw=1.5, label=f"{limit_name} {fmt.format(limit)}")
    ax.set_xlim(0, right)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def families_chart(result: RunResult, path: Path) -> Path | None:
    data: FamilyChart = family_bars(result)
    bars = data.bars
    if not bars:
        return None
    fig, (ax_h, ax_d) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.55 * len(bars)), sharey=True)
    selected = [b.selected for b in bars]
    ax_h.set_yticks(range(len(bars)), [f"{b.family}\n{b.label} ({b.status})" for b in bars], fontsize=8)
    ax_h.invert_yaxis()
    # Runs under an hour are drawn in minutes, so their intervals read as numbers, not "0.1 h".
    k = 60.0 if max([b.hours.high for b in bars] + [data.max_hours or 0.0]) < 1 else 1.0
    fmt, unit = ("{:,.1f} min", "minutes") if k > 1 else ("{:,.1f} h", "hours")
    limit = data.max_hours * k if data.max_hours else None
    _interval_panel(ax_h, [_scaled(b.hours, k) for b in bars], selected, fmt, limit, "max_hours")
    ax_h.set_xlabel(f"wall-clock {unit}, interruptions and restarts included")
    ax_h.set_title("Hours to train", fontsize=10)
    if data.priced:
        _interval_panel(
            ax_d, [b.dollars for b in bars], selected, "${:,.0f}", data.max_dollars, "max_dollars"
        )
    else:
        ax_d.text(
            0.5,
            0.5,
            "no price per GPU-hour for this cluster:\nevery plan costs $0",
            ha="center",
            va="center",
            transform=ax_d.transAxes,
        )
        ax_d.set_xticks([])
    ax_d.set_xlabel("dollars, interruptions and restarts included")
    ax_d.set_title("Dollars", fontsize=10)
    _bold_selected(ax_h, selected)
    against = "against the budget" if data.max_hours or data.max_dollars else "(the budget sets no limit)"
    fig.suptitle(
        f"Best plan of each strategy family: hours and dollars with 80 % intervals {against}; "
        "selected plan in red",
        fontsize=11,
    )
    fig.tight_layout()
    return _save(fig, path)


# -- memory per plan --------------------------------------------------------------------------------------


def memory_chart(result: RunResult, path: Path) -> Path | None:
    data: MemoryChart | None = memory_bars(result)
    if data is None:
        return None
    bars, n = data.bars, len(data.bars)
    fig, ax = plt.subplots(figsize=(13, 2.2 + 0.42 * n))
    y = list(range(n))
    left = [0.0] * n
    for term in TERMS:
        vals = [b.terms[term] for b in bars]
        ax.barh(y, vals, left=left, height=0.62, color=TERM_COLORS[term], label=term)
        left = [a + v for a, v in zip(left, vals, strict=True)]
    # The scale stops short of a plan far past the device memory (its total says "off the scale").
    cap = max(data.device_memory, data.limit) * 1.25
    right = max([b.high for b in bars if b.high <= cap] + [data.device_memory, data.limit]) * 1.45
    totals = [b.total for b in bars]
    err = [[max(b.total - b.low, 0.0) for b in bars], [max(b.high - b.total, 0.0) for b in bars]]
    ax.errorbar(totals, y, xerr=err, fmt="none", ecolor="black", capsize=3, lw=1.1, label="total, range")
    box = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1}
    for i, b in enumerate(bars):
        text = f"{_gib(b.total)} GiB (range {_gib(b.low, b.total)}–{_gib(b.high, b.total)})"
        if b.host > 0:
            text += f" + {_size(b.host)} on host"
        off = b.high > cap
        ax.text(
            right * 0.99 if off else b.high + right * 0.01,
            i,
            text + (" ▶ off the scale" if off else ""),
            va="center",
            ha="right" if off else "left",
            fontsize=8,
            bbox=box,
            zorder=5,
        )
    ax.axvline(
        data.limit,
        color=SELECTED_COLOR,
        linestyle="--",
        lw=1.5,
        label=f"limit {_gib(data.limit)} GiB (after headroom)",
    )
    memory_name = "memory per worker" if data.device_name == "cpu" else "HBM"
    ax.axvline(
        data.device_memory,
        color="grey",
        linestyle=":",
        lw=1.5,
        label=f"{memory_name} {_gib(data.device_memory)} GiB",
    )
    ax.set_yticks(y, [f"{b.label} ({b.status})" for b in bars], fontsize=8)
    _bold_selected(ax, [b.selected for b in bars])
    ax.invert_yaxis()
    ax.set_xlim(0, right)
    ax.set_xlabel(f"GiB per GPU ({data.device_name})")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(
        "Memory per GPU of each plan shown, by term: the total and its range (the extrapolation rule's "
        "band, not a checked 80 % interval) against the limit",
        fontsize=11,
    )
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=5, bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))
    return _save(fig, path)


# -- cost against throughput -----------------------------------------------------------------------------


def _front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(tokens/s, dollars) points no other point beats on both: cheaper first."""
    front, best = [], -1.0
    for tokens, dollars in sorted(points, key=lambda p: (p[1], -p[0])):
        if tokens > best:
            front.append((tokens, dollars))
            best = tokens
    return front


def cost_vs_throughput(result: RunResult, path: Path) -> Path | None:
    points = [(p[0], p[1], p[2]) for p in result.scatter] or [
        (r.tokens_per_s.value, r.dollars.value, 1.0) for r in result.rows if r.status != "over memory"
    ]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for meets, color, label in (
        (1.0, "tab:blue", "meets the budget"),
        (0.0, "tab:grey", "misses the budget"),
    ):
        sel = [(t, d) for t, d, m in points if m == meets]
        if sel:
            ax.scatter(
                [t for t, _ in sel],
                [d for _, d in sel],
                s=10,
                alpha=0.5,
                color=color,
                label=f"plans that fit in memory, {label}",
            )
    front = _front([(t, d) for t, d, _ in points])
    ax.plot(
        [t for t, _ in front],
        [d for _, d in front],
        color="tab:orange",
        marker="o",
        label="Pareto front (no plan cheaper and faster)",
    )
    sel_row = result.selected
    if sel_row is not None:
        tk, dl = sel_row.tokens_per_s, sel_row.dollars
        ax.errorbar(
            [tk.value],
            [dl.value],
            xerr=[[tk.value - tk.low], [tk.high - tk.value]],
            yerr=[[dl.value - dl.low], [dl.high - dl.value]],
            fmt="*",
            color="red",
            markersize=14,
            label=f"selected {sel_row.label} (80 %)",
        )
    budget = result.budget.max_dollars
    if budget:
        ax.axhline(budget, color="red", linestyle="--", label=f"max_dollars ${budget:,.0f}")
    log = all(d > 0 for _, d, _ in points)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("tokens/s (whole cluster)")
    ax.set_ylabel("dollars, interruptions included" + (" (log)" if log else " (no price set)"))
    ax.set_title("Cost against throughput, every plan that fits in memory")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


# -- what the proxies check ------------------------------------------------------------------------------


def proxy_chart(result: RunResult, path: Path) -> Path | None:
    ok = [p for p in result.proxies if p.status == "ok" and p.measured]
    if not ok:
        return None
    words = proxy_text(result)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, (key, _), title in zip(axes, PROXY_TERMS, words.panel_titles, strict=True):
        pts: list[float] = []
        calibrated = False
        for n, p in enumerate(ok, start=1):
            m = p.measured.get(key)
            prior = p.predicted_prior.get(key)
            if not m or prior is None:
                continue
            m, prior = m / MIB, prior / MIB
            ax.scatter([prior], [m], marker="o", s=90, facecolors="none", edgecolors="tab:grey", lw=1.5)
            pts += [m, prior]
            cal = p.predicted_calibrated.get(key)
            if cal is not None:
                ax.scatter([cal / MIB], [m], marker="s", s=25, color="tab:green")
                pts.append(cal / MIB)
                calibrated = True
            ax.annotate(str(n), (prior, m), xytext=(5, 4), textcoords="offset points", fontsize=9)
        if pts:
            lo, hi = min(pts) * 0.9, max(pts) * 1.1
            ax.plot([lo, hi], [lo, hi], linestyle="--", color="grey", label="model exact")
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="tab:grey", label="analytical prior")
        if calibrated:
            ax.scatter([], [], marker="s", color="tab:green", label="calibrated on proxies")
        ax.set_xlabel(words.xlabel)
        ax.set_ylabel(words.ylabel)
        ax.set_title("\n".join(textwrap.wrap(title, 48)), fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(words.title, fontsize=11)
    key = "; ".join(f"{n} = {p.proxy_label}" for n, p in enumerate(ok, start=1))
    foot = [words.built + ".", words.note, f"Points: {key}."]
    fig.text(
        0.01, -0.01, "\n".join(line for f in foot for line in textwrap.wrap(f, WRAP)), fontsize=8, va="top"
    )
    fig.tight_layout()
    return _save(fig, path)


def draw_all(result: RunResult, folder: Path) -> dict[str, Path]:
    made = {
        "families": families_chart(result, folder / "families_hours_dollars.png"),
        "memory": memory_chart(result, folder / "memory_breakdown.png"),
        "cost_vs_throughput": cost_vs_throughput(result, folder / "cost_vs_throughput.png"),
        "proxies": proxy_chart(result, folder / "proxies_predicted_vs_measured.png"),
    }
    return {k: v for k, v in made.items() if v is not None}
