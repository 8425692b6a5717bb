"""`SearchSpace`: which `Plan` fields a search varies at proxy scale, with constraints and the metric.

A space is strict data (YAML or Python, same schema). Every field of `params` is a `Plan` field and
takes a list of values (a single value means fixed); `dp` is not a parameter: at proxy scale it is
derived as proxy.num_workers / (tp·pp·cp), so every point is a full `Plan` that `plan_problem` judges.

Example (YAML):
    name: tiny-cpu
    metric: tokens_per_s          # what the proxy reports; mode defaults to the metric's direction
    params:
      zero_stage: [0, 1, 2, 3]
      micro_batch: [1, 2, 4]
      recompute: [none, full]
    constraints:
      exclude: [{zero_stage: 3, micro_batch: 4}]
    search: {algorithm: grid, max_trials: 6, patience: 3}
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from service.spec.errors import SpecError, validate_as
from service.spec.plan import Plan

Metric = Literal["tokens_per_s", "samples_per_s", "step_time_s", "peak_memory_bytes_per_rank"]
Algorithm = Literal["grid", "random", "bayes"]
METRIC_MODES: dict[str, str] = {
    "tokens_per_s": "max",
    "samples_per_s": "max",
    "step_time_s": "min",
    "peak_memory_bytes_per_rank": "min",
}


def _as_list(value: Any) -> Any:
    """A field's values: a list, a tuple, Ray Tune's `tune.grid_search([...])` or `tune.choice([...])`
    (a search space written for Tune works here), or one value (fixed)."""
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, dict) and set(value) == {"grid_search"}:  # what tune.grid_search returns
        return list(value["grid_search"])
    categories = getattr(value, "categories", None)  # tune.choice: a Categorical domain
    if isinstance(categories, list | tuple):
        return list(categories)
    if type(value).__module__.startswith("ray.tune"):
        raise ValueError(
            f"{type(value).__name__} is a continuous Tune domain; plan fields take finite values "
            "(a list, tune.grid_search or tune.choice)"
        )
    return [value]


# `Plan` fields a proxy cannot vary, each with the reason (read after "<field> is"); a space naming one
# is refused with it. Every other `Plan` field is a search parameter, with Plan's own value type and
# description: a field added to `Plan` is searchable at once (a value the proxy cannot lay out is
# pruned as invalid, with `proxy_plan_problem`'s reason), unless it is listed here.
NOT_SEARCHED: dict[str, str] = {
    "dp": "derived at proxy scale (proxy.num_workers / (tp·pp·cp))",
    "precision": "the proxy's own (proxy.precision)",
    "virtual_stages": "1 for proxies: DeepSpeed's pipeline engine runs plain 1F1B only",
    "engine": "deepspeed for proxies: they run the engine the service runs",
    "comm_overlap": "Megatron-Core's (engine megatron); proxies run deepspeed",
    "tp_comm_overlap": "Megatron-Core's (engine megatron); proxies run deepspeed",
}


def _searched() -> dict[str, FieldInfo]:
    return {name: f for name, f in Plan.model_fields.items() if name not in NOT_SEARCHED}


def _refuse_not_searched(data: Any) -> None:
    for name in data:
        if name in NOT_SEARCHED:
            raise ValueError(f"{name} is {NOT_SEARCHED[name]}; remove it")


class _ParamSpaceBase(BaseModel):
    """Values each `Plan` field may take; a field left out keeps the `Plan` default (one value).

    The fields are `Plan`'s own (see `NOT_SEARCHED`), each a list of Plan's value type."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _scalars_to_lists(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_not_searched(data)
            return {k: None if v is None else _as_list(v) for k, v in data.items()}
        return data

    @field_validator("*")
    @classmethod
    def _positive(cls, values: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        counts = Plan.model_fields[str(info.field_name)].annotation is int  # degrees and batch sizes
        if counts and values and any(v <= 0 for v in values):
            raise ValueError(f"values must be positive, got {values}")
        return values

    def varied(self) -> dict[str, list[Any]]:
        """The fields given, in `Plan`'s order, with their values (duplicates dropped)."""
        out: dict[str, list[Any]] = {}
        for name in type(self).model_fields:
            values = getattr(self, name)
            if values is not None:
                out[name] = list(dict.fromkeys(values))
        return out


class _PartialPlanBase(BaseModel):
    """Some `Plan` fields with one value each: a combination a constraint refers to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _searched_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_not_searched(data)
        return data

    def matches(self, point: dict[str, Any]) -> bool:
        given = self.model_dump(exclude_none=True)
        return bool(given) and all(point.get(k) == v for k, v in given.items())


def _fields(list_of: bool) -> dict[str, Any]:
    """`Plan`'s searched fields for `create_model`: optional, as a list of values or as one value."""
    out: dict[str, Any] = {}
    for name, f in _searched().items():
        value: Any = f.annotation
        values: Any = Optional[list[value] if list_of else value]  # type: ignore[valid-type]  # noqa: UP045
        out[name] = (values, Field(None, description=f.description))
    return out


if TYPE_CHECKING:  # mypy sees the bases; the fields are Plan's, made below
    ParamSpace = _ParamSpaceBase
    PartialPlan = _PartialPlanBase
else:
    ParamSpace = create_model("ParamSpace", __base__=_ParamSpaceBase, __module__=__name__, **_fields(True))
    PartialPlan = create_model(
        "PartialPlan", __base__=_PartialPlanBase, __module__=__name__, **_fields(False)
    )


class Constraints(BaseModel):
    """Rules on top of `plan_problem` (which always applies): batch limits and excluded combinations."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sequences_per_step: int | None = Field(
        None, gt=0, description="Keep micro_batch·grad_accum·dp equal to this (same optimisation problem)."
    )
    max_sequences_per_step: int | None = Field(
        None, gt=0, description="Upper bound on micro_batch·grad_accum·dp."
    )
    exclude: list[PartialPlan] = Field(default_factory=list, description="Combinations never to run.")

    def violation(self, point: dict[str, Any], sequences_per_step: int) -> str | None:
        """Why `point` breaks a constraint, or None."""
        if self.sequences_per_step is not None and sequences_per_step != self.sequences_per_step:
            return (
                f"constraint sequences_per_step: micro_batch·grad_accum·dp = {sequences_per_step}, "
                f"not {self.sequences_per_step}"
            )
        if self.max_sequences_per_step is not None and sequences_per_step > self.max_sequences_per_step:
            return f"constraint max_sequences_per_step: {sequences_per_step} > {self.max_sequences_per_step}"
        for i, rule in enumerate(self.exclude):
            if rule.matches(point):
                return f"constraint exclude[{i}]: {rule.model_dump(exclude_none=True)}"
        return None


class AshaSettings(BaseModel):
    """ASHA early stopping (Li et al. 2018, arXiv:1810.05934) on the metric, by optimizer step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grace_period: int | None = Field(
        None, gt=0, description="Steps before a trial can be stopped; default: proxy warm-up steps + 3."
    )
    reduction_factor: float = Field(2.0, gt=1, description="Keep the best 1/reduction_factor at each rung.")


class SearchSettings(BaseModel):
    """Defaults for `Search(...)`; arguments and CLI flags override them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Algorithm = Field("grid", description="grid (model order), random, or bayes (Optuna TPE).")
    max_trials: int | None = Field(None, gt=0, description="Most trials to launch; default: every candidate.")
    patience: int | None = Field(
        None, gt=0, description="Stop after this many finished trials without improving the best."
    )
    steps: int | None = Field(None, gt=0, description="Optimizer steps per trial; default: proxy.steps.")
    trial_timeout_s: float = Field(
        900.0, gt=0, description="A trial still running this long after its workers were placed is a hang."
    )
    # Cloud GPU nodes take minutes to boot (3-8 min is common for 8-GPU instances), and a trial may
    # wait behind the trials before it for capacity; 10 minutes covers both on a healthy cluster.
    pending_timeout_s: float = Field(
        600.0,
        gt=0,
        description="A trial whose workers are not placed this long after it started is unschedulable.",
    )
    asha: AshaSettings | None = Field(
        default_factory=AshaSettings, description="null turns early stopping off."
    )  # type: ignore[arg-type]
    seed: int = Field(0, description="Seed for random order and the Optuna sampler.")


class SearchSpace(BaseModel):
    """A named search space: `params` (Plan fields → values), `constraints`, `metric` and `mode`.

    Built in Python the way a Ray Tune `param_space` is: lists, `tune.grid_search` or `tune.choice` per
    field, and `algorithm` (or any `search` setting) given directly.

    Example:
        >>> from ray import tune
        >>> space = SearchSpace(
        ...     params={"zero_stage": [1, 2, 3], "micro_batch": tune.grid_search([1, 2]),
        ...             "recompute": tune.choice(["none", "full"])},
        ...     constraints={"exclude": [{"zero_stage": 3, "micro_batch": 2}]},
        ...     algorithm="bayes",
        ... )
        >>> space.size(), space.search.algorithm, space.mode
        (12, 'bayes', 'max')
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("space", description="Space name (MLflow run names, results folder).")
    description: str = Field("", description="What the space is for.")
    experiment: str | None = Field(
        None,
        description="The experiment (its `name`) the space was written for: a search of another "
        "experiment with it is refused. None: any experiment.",
    )
    params: ParamSpace = Field(description="Plan fields to vary, each with its list of values.")
    constraints: Constraints = Field(default_factory=Constraints)  # type: ignore[arg-type]
    metric: Metric = Field("tokens_per_s", description="Measured metric the search optimises.")
    mode: Literal["max", "min"] | None = Field(
        None, description="Direction; default: the metric's natural one."
    )
    search: SearchSettings = Field(default_factory=SearchSettings)  # type: ignore[arg-type]

    if TYPE_CHECKING:  # the signature mypy checks callers against: the `search` settings may come flat

        def __init__(
            self,
            *,
            params: ParamSpace | dict[str, Any],
            constraints: Constraints | dict[str, Any] = ...,
            name: str = ...,
            description: str = ...,
            metric: Metric = ...,
            mode: Literal["max", "min"] | None = ...,
            search: SearchSettings | dict[str, Any] = ...,
            algorithm: Algorithm = ...,
            max_trials: int | None = ...,
            patience: int | None = ...,
            steps: int | None = ...,
            trial_timeout_s: float = ...,
            pending_timeout_s: float = ...,
            asha: AshaSettings | dict[str, Any] | None = ...,
            seed: int = ...,
        ) -> None: ...

    @field_validator("params")
    @classmethod
    def _not_empty(cls, params: ParamSpace) -> ParamSpace:
        varied = params.varied()
        if not varied:
            raise ValueError("empty space: give at least one Plan field with its values")
        empty = [k for k, v in varied.items() if not v]
        if empty:
            raise ValueError(f"empty space: {empty[0]} has no values")
        return params

    @field_validator("constraints")
    @classmethod
    def _rules_can_match(cls, constraints: Constraints, info: ValidationInfo) -> Constraints:
        """An exclude rule on a field not searched, or on a value not among its values, matches nothing:
        refused, as a typo'd stage (2 for 3) would otherwise run the plans it meant to exclude."""
        params = info.data.get("params")
        if params is None or (info.context or {}).get("restored"):  # refused already; or a saved search's
            return constraints
        varied = params.varied()
        for i, rule in enumerate(constraints.exclude):
            for k, v in rule.model_dump(exclude_none=True).items():
                if k not in varied:
                    raise ValueError(f"exclude[{i}]: {k} is not searched (not in params): it never matches")
                if v not in varied[k]:
                    raise ValueError(f"exclude[{i}]: {k} {v!r} is not among params.{k} {varied[k]}")
        return constraints

    @model_validator(mode="before")
    @classmethod
    def _settings_at_top_level(cls, data: Any) -> Any:
        """`SearchSpace(..., algorithm="bayes")`: `search` settings may be given beside `params`."""
        if not isinstance(data, dict):
            return data
        top = {k: data[k] for k in SearchSettings.model_fields if k in data}
        if not top:
            return data
        search = data.get("search") or {}
        search = search.model_dump(exclude_unset=True) if isinstance(search, SearchSettings) else search
        if isinstance(search, dict):
            clash = sorted(set(top) & set(search))
            if clash:
                raise ValueError(f"{clash[0]} is given twice: at the top level and under search")
            search = {**search, **top}
        rest = {k: v for k, v in data.items() if k not in top}
        return {**rest, "search": search}

    @model_validator(mode="after")
    def _default_mode(self) -> SearchSpace:
        if self.mode is None:
            object.__setattr__(self, "mode", METRIC_MODES[self.metric])
        return self

    @property
    def direction(self) -> str:
        return self.mode or METRIC_MODES[self.metric]

    def points(self) -> list[dict[str, Any]]:
        """Every combination of the given values, in a fixed order (the YAML's order of values)."""
        varied = self.params.varied()
        names = list(varied)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*varied.values())]

    def size(self) -> int:
        n = 1
        for values in self.params.varied().values():
            n *= len(values)
        return n


def load_space(path: str | Path) -> SearchSpace:
    """Reads a search-space YAML; any error is one `SpecError` naming the file and field."""
    from service.spec.experiment import read_yaml

    data = read_yaml(path)
    if data is None:
        raise SpecError("(top level)", "empty space: the file has no fields", str(path))
    if not isinstance(data, dict):
        raise SpecError("(top level)", "expected a mapping with name, params, metric", str(path))
    data.setdefault("name", Path(path).stem)
    return space_from_dict(data, str(path))


def space_from_dict(data: Any, source: str | None = None) -> SearchSpace:
    """`SearchSpace` from plain data (Python API), with the same one-line errors as the YAML."""
    return validate_as(SearchSpace, data, source)
