"""`RunResult`: everything `run` decided, as typed records that serialise to one JSON document.

The memo (service/report) is drawn from this document alone, so `python -m service report` can rebuild
it from a finished run's `result.json`. Every number carries a provenance tag (see `TAGS`). The schema
lives here, beside the memo that reads it, so that `run` imports `report` and never the reverse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.report.decision_records import (
    Alternative,
    Evidence,
    ExpertParallelism,
    Goodput,
    OtherEngines,
    Sensitivity,
    TieGroup,
)
from service.report.proxy_records import Calibration, ProxyDesign, ProxyValidation
from service.spec.plan import Plan
from service.spec.record import Metrics
from service.spec.strict_json import as_string, non_finite_replaced
from service.spec.units import GIB
from service.spec.workload import Budget

PRIOR = "analytical prior"
PUBLISHED = "fit on published runs"  # the shipped parameter set (benchmarks/published), not these proxies
CALIBRATED = "calibrated on proxies"
MEASURED = "measured"
TAGS = (PRIOR, PUBLISHED, CALIBRATED, MEASURED)
# A PlanRow status: plan B, for when the choice's memory interval passes the limit.
MEMORY_FALLBACK = "memory fallback"


class Interval(BaseModel):
    """A point value, its 80 % interval, and where it comes from (one of `TAGS`)."""

    model_config = ConfigDict(frozen=True)

    value: float
    low: float
    high: float
    tag: str = PRIOR

    @property
    def interval(self) -> tuple[float, float]:
        return (self.low, self.high)

    def __str__(self) -> str:  # pydantic's own __str__ lists every field
        return repr(self)

    def __repr__(self) -> str:
        return f"Interval({self.value:,.4g} [{self.low:,.4g}, {self.high:,.4g}] {self.tag})"

    def public(self) -> Figure:
        return Figure(value=self.value, interval=(self.low, self.high), tag=self.tag)


class Figure(BaseModel):
    """A headline number as `run --json` prints it: the value, its 80 % interval, its provenance tag."""

    model_config = ConfigDict(frozen=True)

    value: float
    interval: tuple[float, float]
    tag: str


class Headline(BaseModel):
    """The selected plan's predicted numbers (`RunResult.predicted`); hours and dollars include goodput."""

    model_config = ConfigDict(frozen=True)

    tokens_per_s: Figure
    hours: Figure
    dollars: Figure
    memory_per_gpu_bytes: Figure
    memory_limit_bytes: float
    mfu: float

    def figures(self) -> dict[str, Figure]:
        """The four numbers with intervals, by name."""
        names = ("tokens_per_s", "hours", "dollars", "memory_per_gpu_bytes")
        return {name: getattr(self, name) for name in names}


class ClusterSummary(BaseModel):
    """The cluster the selected plan runs on, as the memo states it."""

    model_config = ConfigDict(frozen=True)

    gpu: str
    num_nodes: int
    gpus_per_node: int
    num_gpus: int
    price_per_gpu_hour_usd: float
    hbm_gib: float
    inter_node_bandwidth_gb_per_s: float | None = None


class PlanRow(BaseModel):
    """One production plan as scored after calibration and goodput."""

    model_config = ConfigDict(frozen=True)

    label: str
    plan: Plan
    gpu: str
    num_gpus: int
    rank: int | None
    status: str
    why: str = ""
    families: list[str] = Field(default_factory=list)
    validated: bool = False  # a proxy of this plan ran
    tokens_per_s: Interval
    hours: Interval  # goodput included (interruptions, checkpoints, restarts)
    dollars: Interval  # goodput included
    hours_no_failures: float  # training time alone
    memory_per_gpu_bytes: Interval
    memory_limit_bytes: float
    hbm_bytes: float
    memory_breakdown: dict[str, float]
    mfu: float

    def __str__(self) -> str:  # pydantic's own __str__ lists every field
        return repr(self)

    def __repr__(self) -> str:
        return (
            f"PlanRow({self.status} {self.label}: {self.tokens_per_s.value:,.0f} tokens/s, "
            f"{self.hours.value:,.2f} h, ${self.dollars.value:,.0f}, "
            f"{self.memory_per_gpu_bytes.value / GIB:.1f} GiB/GPU)"
        )


class ProxyTrial(BaseModel):
    """One proxy run: which production plan it stands for, what it measured, what the model said."""

    model_config = ConfigDict(frozen=True)

    trial_id: str
    production_label: str
    proxy_label: str
    proxy_plan: Plan
    status: str
    reason: str = ""
    measured: Metrics = Metrics()
    predicted_prior: Metrics = Metrics()  # the cost model with the shipped parameters
    predicted_calibrated: Metrics = Metrics()  # with the parameters fitted on these proxies
    mlflow_run_id: str | None = None


class Assumption(BaseModel):
    """One thing the memo's numbers rest on, and where it comes from."""

    model_config = ConfigDict(frozen=True)

    what: str
    source: str


class Scale(BaseModel):
    """A model on a cluster, as far as extrapolating from a proxy to production goes."""

    model_config = ConfigDict(frozen=True)

    layers: int
    hidden_size: int
    seq_len: int
    gpus: int
    device: str


class Extrapolation(BaseModel):
    """How far the production plan lies from its proxies, and how much that widens the memory interval."""

    model_config = ConfigDict(frozen=True)

    proxy: Scale
    production: Scale
    doublings: dict[str, float]
    widening: float
    rule: str


class RunResult(BaseModel):
    """What `Run.fit()` returns; `to_json()` is what `run --json` prints."""

    model_config = ConfigDict(frozen=True)

    experiment: str
    objective: str
    budget: Budget
    cluster: ClusterSummary
    created: str
    selected_plan: Plan | None
    selected_label: str | None
    predicted: Headline | None = None  # None when no plan was selected
    message: str
    binding_constraint: str | None = None
    plans_ranked: int = 0
    rows: list[PlanRow] = Field(default_factory=list)  # selected, runners-up, validated, pareto front
    # every plan that fits in memory: [tokens/s, dollars, meets the budget (1/0)], for the cost chart
    scatter: list[list[float]] = Field(default_factory=list)
    proxy_design: ProxyDesign = Field(default_factory=ProxyDesign)
    proxies: list[ProxyTrial] = Field(default_factory=list)
    calibration: Calibration = Field(default_factory=Calibration)
    proxy_validation_error: ProxyValidation = Field(default_factory=ProxyValidation)
    extrapolation: Extrapolation | None = None
    goodput: Goodput | None = None
    sensitivity: Sensitivity | None = None
    ties: TieGroup | None = None
    evidence: Evidence | None = None
    experts: ExpertParallelism | None = None  # MoE models only
    alternatives: list[Alternative] = Field(default_factory=list)
    other_engines: OtherEngines | None = None  # the best plan of listed engines `run` does not launch
    risks: list[str] = Field(default_factory=list)
    assumptions: list[Assumption] = Field(default_factory=list)
    ds_config: dict[str, Any] = Field(default_factory=dict)
    ds_config_path: str | None = None
    launch_command: str | None = None  # the Ray job (python -m service train), else the DeepSpeed launcher
    deepspeed_command: str | None = None  # DeepSpeed's launcher with your own training script
    memo_paths: dict[str, str] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    out_dir: str = ""
    copied_to: str | None = None  # the run folder's copy at $SERVICE_STORAGE_PATH when that is a URI
    search_path: str | None = None
    wall_s: float = 0.0

    @property
    def selected(self) -> PlanRow | None:
        return next((r for r in self.rows if r.status == "selected"), None)

    def _value(self, key: str) -> float | None:
        return None if self.predicted is None else self.predicted.figures()[key].value

    @property
    def dollars(self) -> float | None:
        """The selected plan's expected dollars (goodput included), or None when none was selected."""
        return self._value("dollars")

    @property
    def hours(self) -> float | None:
        return self._value("hours")

    @property
    def tokens_per_s(self) -> float | None:
        return self._value("tokens_per_s")

    @property
    def memory_per_gpu_bytes(self) -> float | None:
        return self._value("memory_per_gpu_bytes")

    def __str__(self) -> str:  # pydantic's own __str__ lists every field
        return repr(self)

    def __repr__(self) -> str:
        if self.selected_label is None:
            return f"RunResult({self.experiment}: no plan selected; {self.binding_constraint})"
        return (
            f"RunResult({self.experiment}: {self.selected_label}, {self.tokens_per_s or 0:,.0f} tokens/s, "
            f"{self.hours or 0:,.2f} h, ${self.dollars or 0:,.0f}; memo {self.memo_paths.get('html', '-')})"
        )

    @property
    def memory_fallback(self) -> PlanRow | None:
        """Plan B: under the memory limit at its interval's high end, when the selected plan is not."""
        return next((r for r in self.rows if r.status == MEMORY_FALLBACK), None)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def save(self, path: str | Path) -> Path:
        """Writes strict JSON (RFC 8259): a regret that is infinite (a plan out of a scenario's budget)
        or undefined is written as the string "Infinity" or "NaN", which `load` reads back as the
        number; Python's bare `Infinity` / `NaN` tokens are refused by JSON parsers."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(non_finite_replaced(self.to_json(), as_string), indent=1, allow_nan=False))
        return p

    @classmethod
    def load(cls, path: str | Path) -> RunResult:
        return cls.model_validate(json.loads(Path(path).read_text()))
