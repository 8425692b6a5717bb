"""The numbers and words the memo's charts draw, prepared from a `RunResult` without matplotlib, so they
can be tested apart from the drawing (service/report/charts.py draws them).

- `family_bars`: hours and dollars of the best plan of every strategy family among the memo's rows,
  each with its 80 % interval, the budget's limits, the selected plan marked;
- `memory_bars`: memory per GPU of every row the memo shows, by term, the total (their sum), its range
  (service/design/calibration.py's extrapolation rule: a band, not a checked 80 % interval), the limit
  and the device memory;
- `proxy_text`: what the proxy chart and the proxy table say the proxies check. CPU proxies check that
  each layout builds and steps and the memory terms per rank; their speed (gloo collectives on CPU
  cores) says nothing of GPU kernels, NVLink or InfiniBand, so it is never shown as evidence for speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.report.result import Interval, PlanRow, RunResult
from service.spec.units import GIB

MIB = 2**20
# GPU memory terms, bottom of the stack first; their sum is the plan's memory per GPU.
TERMS = ("params", "grads", "optimizer", "activations", "logits", "buffers", "overhead")
HOST_TERM = "cpu_offload"  # offloaded states: host memory, not part of the GPU total
SELECTED = "selected"
# Proxy measurements the chart compares with the model (per rank).
PROXY_TERMS = (
    ("activation_bytes_per_rank", "Activations per rank"),
    ("model_state_bytes_per_rank", "Model states per rank (params, grads, optimizer)"),
)
CPU_SPEED_WHY = (
    "the proxies ran on CPU cores with gloo collectives, which say nothing of GPU kernels, NVLink or "
    "InfiniBand"
)


def _rank_key(row: PlanRow) -> tuple[bool, bool, int]:
    """The selected plan first, then the cost model's ranking; unranked plans (over memory) last."""
    return (row.status != SELECTED, row.rank is None, row.rank or 0)


@dataclass(frozen=True)
class FamilyBar:
    family: str
    label: str  # the plan standing for the family: the best of the family among the memo's rows
    status: str
    hours: Interval
    dollars: Interval

    @property
    def selected(self) -> bool:
        return self.status == SELECTED


@dataclass(frozen=True)
class FamilyChart:
    bars: list[FamilyBar]  # in the order of the strategy families of the rows
    max_hours: float | None
    max_dollars: float | None
    priced: bool  # False when every dollar figure is 0 (a cluster without a price)


def family_bars(result: RunResult) -> FamilyChart:
    """One bar per strategy family present in the memo's rows: the family's best plan (the selected
    plan for its own families, else the best-ranked)."""
    families: list[str] = []
    for row in result.rows:
        families += [f for f in row.families if f not in families]
    bests: dict[str, tuple[list[str], PlanRow]] = {}  # plan label → (its families here, the row)
    for fam in families:
        best = min((r for r in result.rows if fam in r.families), key=_rank_key)
        bests.setdefault(best.label, ([], best))[0].append(fam)
    # One bar per plan: a plan that is the best of several families carries all their names.
    bars = [
        FamilyBar(" · ".join(fams), row.label, row.status, row.hours, row.dollars)
        for fams, row in bests.values()
    ]
    budget = result.budget
    return FamilyChart(
        bars=bars,
        max_hours=_positive(budget.max_hours),
        max_dollars=_positive(budget.max_dollars),
        priced=any(b.dollars.high > 0 for b in bars),
    )


def _positive(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and x > 0 and math.isfinite(x) else None


@dataclass(frozen=True)
class MemoryBar:
    label: str
    status: str
    terms: dict[str, float]  # GiB per GPU by term, in `TERMS` order
    total: float  # GiB per GPU: the sum of `terms`
    low: float  # the total's range (extrapolation rule), GiB
    high: float
    host: float  # GiB per GPU offloaded to host memory (not in the total)

    @property
    def selected(self) -> bool:
        return self.status == SELECTED


@dataclass(frozen=True)
class MemoryChart:
    bars: list[MemoryBar]  # the memo's rows, in its order (selected first)
    limit: float  # GiB per GPU after headroom
    device_memory: float  # GiB per GPU (HBM)
    device_name: str


def memory_bars(result: RunResult) -> MemoryChart | None:
    rows = result.rows
    if not rows:
        return None
    bars = []
    for r in rows:
        terms = {t: r.memory_breakdown.get(t, 0.0) / GIB for t in TERMS}
        iv = r.memory_per_gpu_bytes
        bars.append(
            MemoryBar(
                label=r.label,
                status=r.status,
                terms=terms,
                total=sum(terms.values()),
                low=iv.low / GIB,
                high=iv.high / GIB,
                host=r.memory_breakdown.get(HOST_TERM, 0.0) / GIB,
            )
        )
    first = rows[0]
    return MemoryChart(bars, first.memory_limit_bytes / GIB, first.hbm_bytes / GIB, first.gpu)


def proxies_on_cpu(result: RunResult) -> bool:
    return result.proxy_design.device == "cpu"


def proxy_speed_unused(result: RunResult) -> bool:
    """Whether the proxies' tokens/s says nothing of production speed: CPU proxies for a GPU cluster."""
    return proxies_on_cpu(result) and result.cluster.gpu != "cpu"


@dataclass(frozen=True)
class ProxyText:
    title: str
    panel_titles: tuple[str, ...]
    xlabel: str
    ylabel: str
    built: str  # how many layouts built and stepped
    note: str  # what the proxies do not say
    caption: str  # the memo's caption under the chart

    def words(self) -> list[str]:
        return [self.title, *self.panel_titles, self.xlabel, self.ylabel, self.built, self.note, self.caption]


def proxy_text(result: RunResult) -> ProxyText:
    trials = result.proxies
    ok = sum(p.status == "ok" for p in trials)
    built = f"{ok} of {len(trials)} proxy layouts built and stepped"
    failed = [p.proxy_label for p in trials if p.status != "ok"]
    if failed:
        built += f" (did not: {', '.join(failed)})"
    if proxies_on_cpu(result):
        where = "CPU proxies"
        note = (
            "Speed is not checked here: " + CPU_SPEED_WHY + "."
            if proxy_speed_unused(result)
            else "CPU cluster: their tokens/s fits the time terms (memo table)."
        )
    else:
        where = f"{result.proxy_design.gpu or 'GPU'} proxies"
        note = "Time terms are compared in the memo's proxy table."
    return ProxyText(
        title=f"What the {where} check: each layout builds and steps; memory terms per rank",
        panel_titles=tuple(f"{name}: model against proxy" for _, name in PROXY_TERMS),
        xlabel="cost model's prediction (MiB per rank)",
        ylabel="measured on the proxy (MiB per rank)",
        built=built,
        note=note,
        caption=f"What the {where} check: layouts build and step; memory terms per rank, predicted "
        "against measured (on the dashed line the model is exact)",
    )
