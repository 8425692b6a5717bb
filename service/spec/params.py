"""`ModelParams`: the cost model's fitted parameters, what they were fit on, and the error they carry.

The analytical cost model (service/costmodel) takes its hardware priors from the GPU catalog. A few
named, physically meaningful factors sit on top of those priors; `service.calibrate` fits them on
measured runs (published, a user's own, proxies) within a plausible band, and scores the fit on runs
it was not fit on (leave-one-source-out). The resulting set is a versioned data file
(service/catalog/params/*.yaml) that says which runs it was fit on, and carries the out-of-sample
residuals from which every estimate's prediction interval is derived.

`ModelParams()` with no arguments is the uncalibrated analytical prior (every factor at its neutral
value, no interval data): the cost model then answers exactly as its cited formulas do.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.spec.param_bands import Band, default_bands

DEFAULT_PARAMS_PATH = Path(__file__).parent.parent / "catalog" / "params" / "default.yaml"


class Domain(BaseModel):
    """The region the fit saw: an estimate outside it gets a wider interval (see `widening`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_gpus: int = Field(0, ge=0, description="Most GPUs of any fitted run (0 = no data).")
    max_seq_len: int = Field(0, ge=0, description="Longest sequence of any fitted run.")
    gpu_types: list[str] = Field(default_factory=list, description="GPU catalog names the fit saw.")
    stacks: list[str] = Field(
        default_factory=list,
        description="Software stacks the fit saw, each on its GPU ('DeepSpeed ZeRO-3, bf16 on "
        "h100-sxm-80gb'; service/spec/stack.py). Empty: the rule for unseen stacks is off.",
    )


class Residuals(BaseModel):
    """Out-of-sample log residuals log(measured / predicted) of the fit, by leave-one-source-out.

    The 80 % interval of a new estimate is predicted × exp([q10, q90] × widening).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(0, ge=0)
    q10: float = 0.0
    q90: float = 0.0
    method: str = ""
    scatter: float = Field(
        0.0,
        ge=0,
        description="Offset-free scatter: the source-weighted RMS of the out-of-sample log residuals "
        "about each source's own mean. Two runs on one software stack can be mispredicted by about "
        "this much relative to each other, so plans closer than it tie (plans/select.py).",
    )


class FitRun(BaseModel):
    """One run the set was fit on, and how far off the fit was on it out of sample (its source left out):
    what the memo prints beside a number as the nearest published evidence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    source: str
    model: str
    params_b: float = Field(ge=0, description="Model parameters, billions.")
    gpu: str
    num_gpus: int = Field(ge=1)
    stack: str = Field(description="Software stack (service/spec/stack.py), without the GPU.")
    plan: str = Field(description="The run's plan label.")
    error: float = Field(description="Out-of-sample predicted / measured − 1 (negative: predicted too slow).")
    seq_len: int | None = Field(
        None, ge=1, description="Tokens per sequence (given for runs kept outside the fit)."
    )


class ModelParams(BaseModel):
    """A named parameter set: values with bands, the runs it was fit on, and its out-of-sample error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("analytical-prior", description="Name of this parameter set.")
    version: int = Field(1, ge=1, description="Bumped whenever the set is refit.")
    created: str = Field("", description="When it was fit (UTC, ISO 8601).")
    fit_on: list[str] = Field(default_factory=list, description="Sources (or run ids) it was fit on.")
    fit_runs: int = Field(0, ge=0, description="How many runs it was fit on.")
    note: str = Field("", description="What a reader must know about this set.")
    values: dict[str, Band] = Field(default_factory=default_bands)
    residuals: Residuals = Field(default_factory=Residuals)
    domain: Domain = Field(default_factory=Domain)
    runs: list[FitRun] = Field(
        default_factory=list,
        description="The fitted runs with their out-of-sample errors (leave-one-source-out).",
    )
    # Log-interval widening per doubling outside the fitted domain (GPUs, sequence length) and for an
    # unseen GPU type; see `widening`.
    widen_per_doubling: float = Field(0.25, ge=0)
    widen_unseen_gpu: float = Field(0.5, ge=0)
    # An unseen software stack on a GPU the fit saw (or a stack seen on no GPU at all): its kernels and
    # runtime carry an offset no fitted source measured (service/spec/stack.py says what a stack is).
    widen_unseen_stack: float = Field(0.5, ge=0)

    @model_validator(mode="after")
    def _complete(self) -> ModelParams:
        defaults = default_bands()
        unknown = sorted(set(self.values) - set(defaults))
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}; allowed: {sorted(defaults)}")
        missing = {k: v for k, v in defaults.items() if k not in self.values}
        if missing:
            object.__setattr__(self, "values", {**missing, **self.values})
        return self

    def __getitem__(self, name: str) -> float:
        return self.values[name].value

    @property
    def has_interval(self) -> bool:
        return self.residuals.n > 0

    def with_values(self, values: dict[str, float], **meta: Any) -> ModelParams:
        """A copy with new values (each kept in its band) and new metadata."""
        bands = {
            k: b.model_copy(update={"value": float(min(max(values.get(k, b.value), b.low), b.high))})
            for k, b in self.values.items()
        }
        return self.model_copy(update={"values": bands, "created": datetime.now(UTC).isoformat(), **meta})

    def at_bounds(self) -> dict[str, str]:
        """Parameters sitting on an edge of their band: the data would push them further."""
        return {k: edge for k, b in self.values.items() if (edge := b.at_bound()) is not None}

    def widening(self, num_gpus: Any, seq_len: Any, gpu_name: str, stacks: Any = None) -> Any:
        """Factor (≥ 1) on the log-interval for an estimate at (num_gpus, seq_len, gpu) — the stated rule:
        1 + widen_per_doubling × (doublings beyond the largest fitted GPU count + doublings beyond the
        longest fitted sequence) + widen_unseen_gpu if the GPU type was not in the fit
        + widen_unseen_stack if the plan's software stack (`stacks`, service/spec/stack.py) was not fit
        on this GPU — on an unseen GPU only if the stack was fit on no GPU at all."""
        import numpy as np

        d = self.domain
        if d.max_gpus == 0:
            return np.ones_like(np.asarray(num_gpus, dtype=float))
        gpus_out = np.maximum(0.0, np.log2(np.asarray(num_gpus, dtype=float) / d.max_gpus))
        seq_out = np.maximum(0.0, np.log2(np.asarray(seq_len, dtype=float) / max(d.max_seq_len, 1)))
        unseen = 0.0 if gpu_name in d.gpu_types else self.widen_unseen_gpu
        return (
            1.0
            + self.widen_per_doubling * (gpus_out + seq_out)
            + unseen
            + self.stack_widening(stacks, gpu_name)
        )

    def stack_widening(self, stacks: Any, gpu_name: str) -> Any:
        """`widen_unseen_stack` where a stack is outside the fit (see `widening`), else 0."""
        import numpy as np

        from service.spec.stack import Stacks

        if stacks is None or not self.domain.stacks:
            return 0.0
        if not isinstance(stacks, Stacks):
            names = tuple(np.atleast_1d(np.asarray(stacks, dtype=object)).tolist())
            distinct = tuple(dict.fromkeys(names))
            stacks = Stacks(np.asarray([distinct.index(n) for n in names], dtype=np.int64), distinct)
        if gpu_name in self.domain.gpu_types:
            unseen = [f"{n} on {gpu_name}" not in self.domain.stacks for n in stacks.names]
        else:
            anywhere = {k.rsplit(" on ", 1)[0] for k in self.domain.stacks}
            unseen = [n not in anywhere for n in stacks.names]
        return np.where(unseen, self.widen_unseen_stack, 0.0)[stacks.codes]

    def summary(self, extra: Residuals | None = None) -> ParamsSummary:
        """What `estimate --json` and `plan --json` print under `params`; `extra`: the residuals a MoE
        plan's interval also takes (`interval_bounds`)."""
        interval = (
            f"80 %: out-of-sample (leave-one-source-out) log residuals q10 {self.residuals.q10:+.3f}, "
            f"q90 {self.residuals.q90:+.3f} over {self.residuals.n} runs, widened outside the fit"
            if self.has_interval
            else "none: fit without leave-one-source-out (one source, or not asked for) or on too few runs"
            if self.fit_runs
            else "none: uncalibrated analytical prior"
        )
        if extra is not None:
            interval += (
                f"; each side at least as wide as the {extra.method}: q10 {extra.q10:+.3f}, "
                f"q90 {extra.q90:+.3f} over {extra.n} runs"
            )
        return ParamsSummary(
            name=self.name,
            version=self.version,
            fit_on=list(self.fit_on),
            fit_runs=self.fit_runs,
            interval=interval,
        )


class ParamsSummary(BaseModel):
    """Which parameter set scored a number: its name and version, what it was fit on, how its interval
    was made (`ModelParams.summary`)."""

    model_config = ConfigDict(frozen=True)

    name: str
    version: int
    fit_on: list[str]
    fit_runs: int
    interval: str


def interval_bounds(
    predicted: Any,
    params: ModelParams,
    num_gpus: Any,
    seq_len: Any,
    gpu_name: str,
    stacks: Any = None,
    extra: Residuals | None = None,
) -> tuple[Any, Any]:
    """(low, high) 80 % interval around `predicted` tokens/s; equal to it when the set has no residuals.
    `stacks`: each plan's software stack (service/spec/stack.py), for the unseen-stack widening.
    `extra`: residuals of runs of a kind the set was not fit on (MoE: service/spec/moe_residuals.py),
    widened for scale but not for the stack they already measure; each side is the wider of the two."""
    import numpy as np

    w = params.widening(num_gpus, seq_len, gpu_name, stacks)
    r = params.residuals
    value = np.asarray(predicted, dtype=float)
    low, high = value * np.exp(min(r.q10, 0.0) * w), value * np.exp(max(r.q90, 0.0) * w)
    if extra is not None:
        scale = params.widening(num_gpus, seq_len, gpu_name)
        low = np.minimum(low, value * np.exp(min(extra.q10, 0.0) * scale))
        high = np.maximum(high, value * np.exp(max(extra.q90, 0.0) * scale))
    return low, high


def load_params(path: str | Path | None = None) -> ModelParams:
    """A parameter set from a YAML file; None = the shipped default (service/catalog/params/default.yaml),
    read once per process (the planner scores hundreds of thousands of plans a second on it)."""
    if path is None:
        return _shipped_params()
    if not isinstance(path, str | Path):
        from service.spec.errors import SpecError

        raise SpecError("params", f"a parameter-set path (str or Path), got {type(path).__name__}")
    return _read_params(Path(path))


def _read_params(p: Path) -> ModelParams:
    from service.spec.errors import validate_as
    from service.spec.experiment import read_yaml

    return validate_as(ModelParams, read_yaml(p), str(p))


@cache
def _shipped_params() -> ModelParams:
    return _read_params(DEFAULT_PARAMS_PATH) if DEFAULT_PARAMS_PATH.is_file() else ModelParams()


def save_params(params: ModelParams, path: str | Path) -> Path:
    """Writes `params` as YAML (the format `load_params` reads)."""
    import yaml

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = params.model_dump(mode="json")
    p.write_text(
        f"# Cost-model parameter set '{params.name}' v{params.version}: written by "
        "`python -m service calibrate`.\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    )
    return p
