"""`Metrics` and `Observation`: what a run measured and what the cost model predicted, as typed records.

Inside the service a quantity is a field (`trial.measured.tokens_per_s`, `trial.predicted["fits"]`),
never a key carrying a `measured_` / `predicted_` prefix. The prefixes exist only at the boundaries
that need flat names, and each is crossed in one place:
- what a worker reports through `ray.train.report` (flat floats: `measured_x`, `predicted_x` and the
  throughput keys): read once, where the driver receives it, by `Observation.from_report`;
- MLflow metric names and table columns (`measured_x`, `predicted_x`, `final_measured_x`), which users
  query and so keep their names: `Metrics.prefixed` / `Observation.flat`.

Example:
    >>> obs = Observation.from_report({"step": 3, "tokens_per_s": 900.0, "loss": 6.1,
    ...                                "measured_peak_memory_bytes_per_rank": 2e9,
    ...                                "predicted_tokens_per_s": 1000.0, "predicted_fits": 1.0})
    >>> obs.measured.tokens_per_s, obs.predicted.tokens_per_s, obs.predicted["fits"]
    (900.0, 1000.0, 1.0)
    >>> obs.flat()["measured_peak_memory_bytes_per_rank"]
    2000000000.0
    >>> obs.measured.model_dump()
    {'tokens_per_s': 900.0, 'loss': 6.1, 'peak_memory_bytes_per_rank': 2000000000.0}
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, overload

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator

MEASURED = "measured_"
PREDICTED = "predicted_"
# Reported under their plain names by the worker (Ray Tune's metric names); they are measurements.
PLAIN_MEASURED = ("tokens_per_s", "samples_per_s", "step_time_s", "loss")


def report_key(quantity: str) -> str:
    """The name a measured quantity has in a worker's report, which is what Ray Tune's schedulers,
    searchers and stoppers read: `tokens_per_s` as is, `peak_memory_bytes_per_rank` as
    `measured_peak_memory_bytes_per_rank`."""
    return quantity if quantity in PLAIN_MEASURED else MEASURED + quantity


def _number(value: Any) -> float | None:
    """A finite float, or None (NaN means "not measured" / "the model could not say")."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class Metrics(BaseModel):
    """Quantities of one side (measured or predicted), per rank where the name says so.

    The common quantities are fields; a quantity the worker or the model adds later is kept as an
    extra float under its own name. Reads like a read-only mapping of the quantities that are set
    (`"tokens_per_s" in m`, `m["loss"]`, `m.get(...)`, `m.items()`), and serialises to exactly that
    mapping, so JSON documents keep their keys.
    """

    model_config = ConfigDict(frozen=True, extra="allow")
    __pydantic_extra__: dict[str, float]

    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    step_time_s: float | None = None
    loss: float | None = None
    peak_memory_bytes_per_rank: float | None = None
    model_state_bytes_per_rank: float | None = None
    activation_bytes_per_rank: float | None = None
    logits_bytes_per_rank: float | None = None
    fits: float | None = None  # predicted only: 1.0 when the plan fits the device's memory
    # measured only, MoE models: the load the routed experts ran at in the busiest metered forward,
    # num_experts·C / (k·tokens) with C the capacity DeepSpeed padded every expert to, averaged over the
    # MoE blocks (service/train/moe.py `padded_load`)
    moe_load: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _numbers_only(cls, data: Any) -> Any:
        """Drops NaN, infinities and non-numbers: a quantity is a finite float or absent."""
        if isinstance(data, Mapping):
            return {str(k): v for k, v in ((k, _number(v)) for k, v in data.items()) if v is not None}
        return data

    @model_serializer(mode="plain")
    def _as_mapping(self) -> dict[str, float]:
        return self.as_dict()

    def as_dict(self) -> dict[str, float]:
        """The quantities that are set: declared ones in declaration order, then extras."""
        out = {name: getattr(self, name) for name in type(self).model_fields}
        out.update(self.__pydantic_extra__ or {})
        return {k: float(v) for k, v in out.items() if v is not None}

    @classmethod
    def from_prefixed(cls, row: Mapping[str, Any], prefix: str) -> Metrics:
        """The `prefix`ed keys of a flat row, without the prefix (e.g. a `predicted_x` prediction)."""
        return cls.model_validate({k.removeprefix(prefix): v for k, v in row.items() if k.startswith(prefix)})

    def prefixed(self, prefix: str) -> dict[str, float]:
        """Flat names for MLflow and tables: `{prefix + quantity: value}`."""
        return {prefix + k: v for k, v in self.as_dict().items()}

    def __repr_args__(self) -> Any:  # only the quantities that are set
        return list(self.as_dict().items())

    # A read-only mapping's reads (what the rest of the service asks of a side).
    def __getitem__(self, key: str) -> float:
        value = self.as_dict().get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.as_dict()

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # a mapping's keys, not pydantic's pairs
        return iter(self.as_dict())

    def __eq__(self, other: object) -> bool:  # equal to another side or a plain mapping of the same numbers
        if isinstance(other, Metrics | Mapping):
            return self.as_dict() == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.as_dict().items()))

    def __len__(self) -> int:
        return len(self.as_dict())

    @overload
    def get(self, key: str) -> float | None: ...
    @overload
    def get(self, key: str, default: float) -> float: ...
    def get(self, key: str, default: float | None = None) -> float | None:
        return self.as_dict().get(key, default)

    def keys(self) -> list[str]:
        return list(self.as_dict())

    def items(self) -> list[tuple[str, float]]:
        return list(self.as_dict().items())


class Observation(BaseModel):
    """One run (or one step of it): what it measured beside what the model predicted for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    measured: Metrics = Metrics()
    predicted: Metrics = Metrics()

    @classmethod
    def from_report(cls, row: Mapping[str, Any]) -> Observation:
        """From one flat report (what `ray.train.report` carries, or a row of Tune's results):
        `measured_x` and the plain throughput keys are measured, `predicted_x` predicted; the rest
        (step, done, Tune's own keys) are not quantities."""
        measured = {k: row[k] for k in PLAIN_MEASURED if k in row}
        measured.update({k.removeprefix(MEASURED): v for k, v in row.items() if k.startswith(MEASURED)})
        return cls(measured=Metrics.model_validate(measured), predicted=Metrics.from_prefixed(row, PREDICTED))

    def flat(self, prefix: str = "") -> dict[str, float]:
        """MLflow's names: `{prefix}measured_x` and `{prefix}predicted_x`."""
        return {**self.measured.prefixed(prefix + MEASURED), **self.predicted.prefixed(prefix + PREDICTED)}
