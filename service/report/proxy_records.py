"""The typed records of `run`'s middle steps: how the proxies were shaped (`ProxyDesign`), what the
calibration on them did (`Calibration`), and how far the model was from what they measured
(`ProxyValidation`). `run` passes them from step to step and `RunResult` keeps them; the memo, the CLI
and the charts read their fields, and they serialise to the same JSON keys a run's `result.json` holds.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from service.spec.params import ParamsSummary


class ProxyChoice(BaseModel):
    """A production plan that gets a proxy, the proxy plan that stands for it, and why."""

    plan: str
    proxy: str
    why: str


class ProxyDesign(BaseModel):
    """The proxy `run` runs: its shape, where it runs, and what it can and cannot identify."""

    device: str = ""  # "cpu" or "cuda"
    gpu: str = ""  # the catalog GPU of a CUDA proxy of the production type, else "cpu"
    num_layers: int = 0
    hidden_size: int = 0
    hidden_scale: int = 1
    num_attention_heads: int = 0
    seq_len: int = 0
    num_workers: int = 0
    precision: str = ""
    steps: int = 0
    warmup_steps: int = 0
    time_terms: str = ""
    why: str = ""
    identifies: list[str] = Field(default_factory=list)
    cannot_identify: list[str] = Field(default_factory=list)
    choices: list[ProxyChoice] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)  # plans left without a proxy, and why


class Calibration(BaseModel):
    """What the calibration on the proxies did: which parameters moved, from what to what."""

    status: str = ""  # "calibrated", or "not calibrated: <why>"
    runs: int = 0
    fitted: list[str] = Field(default_factory=list)
    before: dict[str, float] = Field(default_factory=dict)
    after: dict[str, float] = Field(default_factory=dict)
    time_terms: str = ""
    params: ParamsSummary | None = None  # the resulting set
    prior: ParamsSummary | None = None  # the starting set
    at_bounds: dict[str, str] = Field(default_factory=dict)  # parameter: the edge of its band it sits on
    source: str = ""  # "proxies:<search name>"

    @property
    def calibrated(self) -> bool:
        return self.status == "calibrated"


class ProxyError(BaseModel):
    """Mean |predicted/measured − 1| of one quantity over the proxies (None: nothing to compare)."""

    prior: float | None = None
    calibrated: float | None = None
    out_of_sample: float | None = None  # leave one proxy out (activations only)


class ProxyValidation(BaseModel):
    """The model against the proxies, per quantity, before and after calibration."""

    n: int = 0  # proxies that ran all their steps
    activation_bytes_per_rank: ProxyError = Field(default_factory=ProxyError)
    model_state_bytes_per_rank: ProxyError = Field(default_factory=ProxyError)
    peak_memory_bytes_per_rank: ProxyError = Field(default_factory=ProxyError)
    tokens_per_s: ProxyError = Field(default_factory=ProxyError)
    note: str = ""
