"""The memo's charts, drawn from a `RunResult` alone (PNG files; the HTML inlines them as base64).

- memory breakdown per GPU of the selected plan and its runners-up, stacked by term, with the limit
  and the interval's high end;
- cost against throughput of every plan shown, Pareto front drawn, the selected plan marked;
- predicted against measured on the proxies (activations and model state, prior and calibrated).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from service.report.result import RunResult

GIB = 2**30
TERMS = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead")
MAX_BARS = 8


def _save(fig, path: Path) -> Path:  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def memory_breakdown(result: RunResult, path: Path) -> Path | None:
    rows = [r for r in result.rows if r.status != "over memory"][:MAX_BARS]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 4.8))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for term in TERMS:
        vals = [r.memory_breakdown.get(term, 0.0) / GIB for r in rows]
        ax.bar(x, vals, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    highs = [r.memory_per_gpu_bytes.high / GIB for r in rows]
    ax.scatter(x, highs, marker="_", s=400, color="black", label="interval high end", zorder=3)
    ax.axhline(rows[0].memory_limit_bytes / GIB, color="red", linestyle="--", label="limit (after headroom)")
    ax.axhline(rows[0].hbm_bytes / GIB, color="grey", linestyle=":", label="HBM")
    ax.set_xticks(list(x), [f"{r.label}\n({r.status})" for r in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("GiB per GPU")
    ax.set_title("Memory per GPU by term (selected first)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


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
    budget = result.budget.get("max_dollars")
    if budget:
        ax.axhline(budget, color="red", linestyle="--", label=f"max_dollars ${budget:,.0f}")
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s (whole cluster)")
    ax.set_ylabel("dollars, interruptions included (log)")
    ax.set_title("Cost against throughput, every plan that fits in memory")
    ax.legend(fontsize=7)
    return _save(fig, path)


def predicted_vs_measured(result: RunResult, path: Path) -> Path | None:
    ok = [p for p in result.proxies if p.status == "ok" and p.measured]
    if not ok:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, unit in zip(
        axes, ("activation_bytes_per_rank", "model_state_bytes_per_rank"), ("MiB", "MiB"), strict=True
    ):
        pts = []
        for p in ok:
            m = p.measured.get(key)
            if not m:
                continue
            ax.scatter([p.predicted_prior.get(key, 0) / 2**20], [m / 2**20], marker="o", color="tab:grey")
            if p.predicted_calibrated:
                ax.scatter(
                    [p.predicted_calibrated.get(key, 0) / 2**20], [m / 2**20], marker="s", color="tab:green"
                )
            ax.annotate(p.proxy_label, (p.predicted_prior.get(key, 0) / 2**20, m / 2**20), fontsize=6)
            pts += [m / 2**20, p.predicted_prior.get(key, 0) / 2**20]
        if pts:
            lo, hi = min(pts) * 0.9, max(pts) * 1.1
            ax.plot([lo, hi], [lo, hi], linestyle="--", color="grey")
        ax.scatter([], [], marker="o", color="tab:grey", label="analytical prior")
        ax.scatter([], [], marker="s", color="tab:green", label="calibrated on proxies")
        ax.set_xlabel(f"predicted ({unit})")
        ax.set_ylabel(f"measured ({unit})")
        ax.set_title(key.replace("_", " "))
        ax.legend(fontsize=7)
    return _save(fig, path)


def draw_all(result: RunResult, folder: Path) -> dict[str, Path]:
    made = {
        "memory": memory_breakdown(result, folder / "memory_breakdown.png"),
        "cost_vs_throughput": cost_vs_throughput(result, folder / "cost_vs_throughput.png"),
        "proxies": predicted_vs_measured(result, folder / "proxies_predicted_vs_measured.png"),
    }
    return {k: v for k, v in made.items() if v is not None}
