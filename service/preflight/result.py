"""What a preflight decided and measured (`PreflightResult`), and its human summary (`main_line`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from service.spec.units import GIB

MIB = 2**20


@dataclass
class PreflightResult:
    """What the preflight decided and measured (`summary()` is the `--json` document)."""

    experiment: str
    plan: str
    verdict: str
    reasons: list[str]
    thresholds: dict[str, Any]
    production: dict[str, Any]
    collectives: list[dict[str, Any]]
    checkpoint: dict[str, Any]
    out_dir: str
    runs_file: str | None = None
    ab: dict[str, Any] | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def go(self) -> bool:
        return not self.reasons

    def summary(self) -> dict[str, Any]:
        return {"go": self.go, **asdict(self)}


def finite(value: Any) -> float | None:
    """`value` as a finite float, or None (a missing or non-numeric metric)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def main_line(result: PreflightResult) -> str:
    """The human summary: the measured numbers, then the verdict on the last line."""
    p = result.production
    lines = [f"plan {result.plan}: {p['status']}, {p['steps']} steps"]
    if p["tokens_per_s"]:
        lines.append(f"  tokens/s {p['tokens_per_s']:,.0f}  step {p['step_time_s']:.4g} s")
    if p["peak_memory_bytes"]:
        lines.append(f"  peak memory (busiest rank) {p['peak_memory_bytes'] / GIB:.2f} GiB")
    for c in result.collectives:
        lines.append(
            f"  {c['op']:14s} {c['scope']:10s} n={c['group_size']}  bus {c['bus_gb_per_s']:.3g} GB/s "
            f"(assumed {c['assumed_bus_gb_per_s']:.3g})"
        )
    c = result.checkpoint
    if "save_s" in c:
        lines.append(
            f"  checkpoint {c.get('bytes', 0) / MIB:.1f} MiB: save {c['save_s']:.3g} s "
            f"({c.get('write_gb_per_s', 0):.3g} GB/s, assumed {c['assumed_storage_gb_per_s']:.3g}), "
            f"load {c.get('load_s', float('nan')):.3g} s"
        )
    if result.ab is not None:
        lines.append(f"  {result.ab['line']}")
    if result.runs_file:
        lines.append(f"  measured run: {result.runs_file}")
    lines.append(result.verdict)
    return "\n".join(lines)
