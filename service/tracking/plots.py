"""Plots a search logs as artifacts: measured vs predicted throughput and memory, throughput per plan.

Each function takes rows `(label, Observation)` (the typed measured/predicted record of
service/spec/record.py) and writes one PNG, so the tracking package needs no knowledge of Ray or of
the search. The diagonal in the scatter plots is "the model was exact".
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; the driver may have no display
import matplotlib.pyplot as plt

from service.spec.record import Observation

Row = tuple[str, Observation]  # a plan's label and what it measured beside what was predicted


def _pairs(rows: Sequence[Row], key: str) -> tuple[list[str], list[float], list[float]]:
    labels, measured, predicted = [], [], []
    for label, observed in rows:
        m, p = observed.measured.get(key), observed.predicted.get(key)
        if m is not None and p is not None and m > 0 and p > 0:
            labels.append(label)
            measured.append(float(m))
            predicted.append(float(p))
    return labels, measured, predicted


def measured_vs_predicted(rows: Sequence[Row], key: str, unit: str, scale: float, path: Path) -> Path | None:
    """Scatter of measured (y) against predicted (x) `key`, values divided by `scale`; None if no data."""
    labels, measured, predicted = _pairs(rows, key)
    if not labels:
        return None
    xs, ys = [v / scale for v in predicted], [v / scale for v in measured]
    fig, ax = plt.subplots(figsize=(6, 5))
    ax.scatter(xs, ys)
    for x, y, label in zip(xs, ys, labels, strict=True):
        ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], linestyle="--", color="grey", label="measured = predicted")
    ax.set_xlabel(f"predicted {key} ({unit})")
    ax.set_ylabel(f"measured {key} ({unit})")
    ax.set_title(f"{key}: measured vs predicted")
    ax.legend(loc="upper left", fontsize=8)
    return _save(fig, path)


def throughput_per_plan(rows: Sequence[Row], key: str, path: Path) -> Path | None:
    """Bars of measured and predicted `key` for every trial, best measured first; None if no data."""
    data = sorted(
        (
            (label, observed.measured.get(key) or 0.0, observed.predicted.get(key) or 0.0)
            for label, observed in rows
        ),
        key=lambda t: -t[1],
    )
    if not data:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(data) + 2), 5))
    index = range(len(data))
    ax.bar([i - 0.2 for i in index], [d[1] for d in data], width=0.4, label="measured")
    ax.bar([i + 0.2 for i in index], [d[2] for d in data], width=0.4, label="predicted")
    ax.set_xticks(list(index), [d[0] for d in data], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(key)
    ax.set_title(f"{key} per plan")
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def search_plots(rows: Sequence[Row], folder: Path) -> list[Path]:
    """The three standard plots of a search (the ones with data), as PNG files in `folder`."""
    made = [
        measured_vs_predicted(
            rows, "tokens_per_s", "tokens/s", 1.0, folder / "tokens_per_s_measured_vs_predicted.png"
        ),
        measured_vs_predicted(
            rows,
            "peak_memory_bytes_per_rank",
            "GiB",
            2.0**30,
            folder / "peak_memory_measured_vs_predicted.png",
        ),
        measured_vs_predicted(
            rows,
            "model_state_bytes_per_rank",
            "MiB",
            2.0**20,
            folder / "model_state_measured_vs_predicted.png",
        ),
        throughput_per_plan(rows, "tokens_per_s", folder / "tokens_per_s_per_plan.png"),
    ]
    return [p for p in made if p is not None]
