"""Go / no-go: thresholds fixed before anything is measured, and the one-line verdict against them.

The thresholds come from what the plan was chosen on, so a preflight fails exactly where the plan's
numbers would be wrong:
- tokens/s: the low end of the estimate's 80 % interval (the parameter set's out-of-sample residuals,
  `ModelParams.interval_bounds`); a run below it is slower than the planner said it could plausibly be;
- memory: the estimate's per-GPU limit (HBM less the headroom the planner keeps), and on a worker
  whose memory is capped (`proxy.memory_limit_gib`) that cap; measured is the busiest rank's peak;
- bandwidth: `min_bandwidth_fraction` of the bus bandwidth the cost model assumed for each collective
  and scope (GPU catalog link GB/s × the parameter set's bus efficiency). nccl-tests reach 80-95 % of
  the link on healthy fabrics and the set's efficiency already discounts that, so the default 0.5 flags
  a link at half what the plan priced: a NIC not in use, traffic on TCP, a degraded switch;
- checkpoint: the storage bandwidth the goodput model assumed (`GoodputSpec.bandwidth_gb_per_s`, the
  aggregate over the plan's GPUs) against bytes written ÷ the slowest rank's save time.
Every threshold can be overridden (the CLI's flags); None turns a check off.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.spec.units import GIB

DEFAULT_BANDWIDTH_FRACTION = 0.5


class Thresholds(BaseModel):
    """What the measurements must meet, stated before the preflight measures anything."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_tokens_per_s: float | None = Field(None, description="Whole-run tokens/s floor (80 % interval low).")
    max_memory_bytes: float | None = Field(None, description="Busiest rank's peak memory ceiling.")
    min_bandwidth_fraction: float | None = Field(
        DEFAULT_BANDWIDTH_FRACTION, description="Floor on measured / assumed bus bandwidth, every collective."
    )
    min_storage_gb_per_s: float | None = Field(None, description="Checkpoint write bandwidth floor (GB/s).")
    sources: dict[str, str] = Field(default_factory=dict, description="Where each threshold comes from.")


def default_thresholds(experiment: Any, plan: Any, params: Any = None) -> Thresholds:
    """The thresholds of `plan` on the experiment's cluster (`experiment` at full scale)."""
    from service.costmodel.estimate import estimate
    from service.spec.errors import SpecError

    sources: dict[str, str] = {}
    min_tps = max_mem = None
    try:
        e = estimate(experiment.model, experiment.cluster, plan, experiment.workload, params=params)
        min_tps = float(e.tokens_per_s_interval[0])
        max_mem = float(e.memory_limit_bytes)
        sources["min_tokens_per_s"] = (
            f"low end of the estimate's 80 % interval ({e.tokens_per_s:,.0f} predicted; {e.params.interval})"
        )
        if params is not None and not params.has_interval:  # no out-of-sample residuals (--no-crossval)
            # would fail a run 0.1 % slow: take the shipped set's interval width around this prediction
            shipped = estimate(experiment.model, experiment.cluster, plan, experiment.workload)
            min_tps = e.tokens_per_s * float(shipped.tokens_per_s_interval[0]) / shipped.tokens_per_s
            sources["min_tokens_per_s"] = (
                f"{e.tokens_per_s:,.0f} predicted less the shipped set's 80 % interval width (the given "
                "parameter set has no out-of-sample interval)"
            )
        sources["max_memory_bytes"] = (
            f"the estimate's memory limit ({experiment.cluster.gpu.name} HBM less headroom)"
        )
    except SpecError as err:  # a plan the cost model cannot price: those two checks are off
        sources["min_tokens_per_s"] = sources["max_memory_bytes"] = f"off: no estimate ({err})"
    cap = experiment.proxy.memory_limit_gib
    if cap is not None and experiment.proxy.device == "cpu":
        cap_bytes = cap * GIB
        if max_mem is None or cap_bytes < max_mem:
            max_mem = cap_bytes
            sources["max_memory_bytes"] = f"the workers' memory cap (proxy.memory_limit_gib = {cap:g})"
    storage = float(experiment.goodput.bandwidth_gb_per_s(plan.num_gpus))
    sources["min_storage_gb_per_s"] = (
        f"goodput model's checkpoint storage ({experiment.goodput.storage_source})"
    )
    sources["min_bandwidth_fraction"] = (
        "of the cost model's bus bandwidth (catalog link GB/s × the parameter set's bus efficiency)"
    )
    return Thresholds(
        min_tokens_per_s=min_tps,
        max_memory_bytes=max_mem,
        min_storage_gb_per_s=storage,
        sources=sources,
    )


def with_overrides(thresholds: Thresholds, **overrides: float | None) -> Thresholds:
    """`thresholds` with each override that is not None in place (its source says so)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    sources = {**thresholds.sources, **{k: "given on the command line" for k in given}}
    return thresholds.model_copy(update={**given, "sources": sources})


def failures(thresholds: Thresholds, measured: dict[str, Any]) -> list[str]:
    """One short reason per threshold missed, in a fixed order; empty when everything passed.

    `measured`: "error" (the run failed), "tokens_per_s", "peak_memory_bytes", "collectives"
    (a list of {op, scope, bus_gb_per_s, assumed_bus_gb_per_s}), "storage_gb_per_s",
    "checkpoint_error", "final_loss"."""
    out: list[str] = []
    if measured.get("error"):
        out.append(f"run failed: {measured['error']}")
    loss = measured.get("final_loss")
    if loss is not None and not math.isfinite(loss):  # a diverged run is no run to launch, however fast
        out.append(f"loss is {loss}")
    tps = measured.get("tokens_per_s")
    if thresholds.min_tokens_per_s is not None and tps is not None and tps < thresholds.min_tokens_per_s:
        out.append(f"tokens/s {tps:,.0f} < {thresholds.min_tokens_per_s:,.0f}")
    mem = measured.get("peak_memory_bytes")
    if thresholds.max_memory_bytes is not None and mem is not None and mem > thresholds.max_memory_bytes:
        out.append(f"peak memory {mem / GIB:.2f} GiB > {thresholds.max_memory_bytes / GIB:.2f} GiB")
    fraction = thresholds.min_bandwidth_fraction
    for c in measured.get("collectives", []):
        need = (fraction or 0.0) * c["assumed_bus_gb_per_s"]
        if fraction is not None and c["bus_gb_per_s"] < need:
            out.append(
                f"{c['op']} {c['scope']} bus bandwidth {c['bus_gb_per_s']:.3g} GB/s < {need:.3g} "
                f"({fraction:g} × assumed {c['assumed_bus_gb_per_s']:.3g})"
            )
    if measured.get("checkpoint_error"):
        out.append(f"checkpoint failed: {measured['checkpoint_error']}")
    storage = measured.get("storage_gb_per_s")
    floor = thresholds.min_storage_gb_per_s
    if floor is not None and storage is not None and storage < floor:
        out.append(f"checkpoint write {storage:.3g} GB/s < {floor:.3g} GB/s (goodput model)")
    return out


def verdict_line(reasons: list[str]) -> str:
    """`GO`, or `NO-GO: <reasons joined by '; '>`."""
    return "GO" if not reasons else "NO-GO: " + "; ".join(reasons)
