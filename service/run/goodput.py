"""Goodput: the wall-clock a run really takes once interruptions, checkpoints and restarts are paid.

- Interruptions arrive at `λ` per GPU-hour, so the job's mean time between failures is M = 1 / (λ · N).
  The experiment sets λ (`goodput.interruptions_per_gpu_hour`); otherwise it depends on the cluster
  (`GoodputSpec.rate_per_gpu_hour`): up to 1,024 GPUs the per-GPU rate of small jobs on Meta's shared
  research clusters (Kokolis et al. 2024: 8-GPU jobs fail every 47.7 days, 1.09e-4 per GPU-hour), above
  it Llama 3's dedicated fleet (419 in 54 days on 16,384 H100s, 1.97e-5 per GPU-hour).
- A checkpoint holds the model state the run cannot recompute: bf16/fp16 weights (2 B/param) plus
  Adam's fp32 master weights and two moments (12 B/param) — the K = 12 of ZeRO (Rajbhandari et al.
  2020, §3.1); 12 B/param in fp32. It is written in parallel at the storage's aggregate bandwidth:
  C = bytes / bandwidth seconds.
- Young's interval (Young 1974; Daly 2006, first order): τ = sqrt(2 · C · M), capped at the run's
  length (a run shorter than τ checkpoints only at its end and loses half of it, on average, per
  interruption).
- Expected wall-clock W = H · (1 + C / τ + (τ / 2 + R + C) / M), H the failure-free hours, R the
  restart time; the failed attempt's checkpoint must be read back (C again). Dollars scale with W.
- The cost of checkpointing more often: W at τ = 1 h, 30 min and 15 min (those shorter than the run),
  against W at the optimum. τ = sqrt(2·C·M) minimises C/τ + τ/(2M), so every other interval costs more.
"""

from __future__ import annotations

import numpy as np

from service.report.result import Goodput, IntervalCost
from service.spec.production import GoodputSpec, checkpoint_bytes

__all__ = ["RULE", "SHORTER_INTERVALS", "checkpoint_bytes", "goodput_record", "interval_costs", "wall_hours"]

RULE = (
    "W = H·(1 + C/τ + (τ/2 + R + C)/M), τ = min(sqrt(2·C·M), H) (Young/Daly); M = 1/(λ·N); "
    "C = checkpoint bytes / storage bandwidth; R = restart time"
)
# The intervals the memo prices against the optimum: (label, hours).
SHORTER_INTERVALS = (("1 h", 1.0), ("30 min", 0.5), ("15 min", 0.25))


def _write_hours(num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> float:
    return ckpt_bytes / (spec.bandwidth_gb_per_s(num_gpus) * 1e9) / 3600.0


def wall_at_interval(hours: float, tau: float, rate: float, c: float, r: float) -> float:
    """W = H·(1 + C/τ + (τ/2 + R + C)·λN) for a checkpoint every τ hours (`rate` = λN per hour)."""
    return hours * (1.0 + c / tau + (tau / 2.0 + r + c) * rate)


def wall_hours(hours: np.ndarray, num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> np.ndarray:
    """Expected wall-clock hours for failure-free `hours` (vectorised over plans)."""
    h = np.asarray(hours, dtype=float)
    rate = spec.rate_per_gpu_hour(num_gpus) * num_gpus
    if rate <= 0:
        return h.copy()
    mtbf = 1.0 / rate
    c = _write_hours(num_gpus, ckpt_bytes, spec)
    tau = np.minimum(np.sqrt(2.0 * c * mtbf), np.maximum(h, 1e-9))
    r = spec.restart_minutes / 60.0
    return h * (1.0 + c / tau + (tau / 2.0 + r + c) / mtbf)


def interval_costs(hours: float, num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> list[IntervalCost]:
    """The optimum's expected wall-clock (as `wall_hours`), then that of a checkpoint every 1 h, 30 min
    and 15 min — those shorter than the run, other than the optimum itself — with their extra over it."""
    rate = spec.rate_per_gpu_hour(num_gpus) * num_gpus
    c = _write_hours(num_gpus, ckpt_bytes, spec)
    r = spec.restart_minutes / 60.0
    tau = min(spec.young_daly_hours(num_gpus, ckpt_bytes), hours)
    best = float(wall_hours(np.array([hours]), num_gpus, ckpt_bytes, spec)[0])
    label = "Young/Daly optimum" if tau < hours else "the run's end only (Young/Daly's is longer)"
    out = [IntervalCost(label=label, interval_hours=tau, wall_hours=best, extra_vs_optimum=0.0)]
    for label, every in SHORTER_INTERVALS:
        if every >= hours or abs(every - tau) <= 1e-9 * max(tau, 1.0):
            continue
        wall = wall_at_interval(hours, every, rate, c, r)
        extra = wall / best - 1.0 if best > 0 else 0.0
        out.append(IntervalCost(label=label, interval_hours=every, wall_hours=wall, extra_vs_optimum=extra))
    return out


def goodput_record(hours: float, num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> Goodput:
    """The numbers behind `wall_hours` for one plan, for the memo."""
    lam = spec.rate_per_gpu_hour(num_gpus)
    rate = lam * num_gpus
    mtbf = 1.0 / rate if rate > 0 else float("inf")
    bandwidth = spec.bandwidth_gb_per_s(num_gpus)
    c_s = ckpt_bytes / (bandwidth * 1e9)
    c = c_s / 3600.0
    young = spec.young_daly_hours(num_gpus, ckpt_bytes)
    tau = min(young, hours)
    wall = float(wall_hours(np.array([hours]), num_gpus, ckpt_bytes, spec)[0])
    failures = wall * rate
    r = spec.restart_minutes / 60.0
    return Goodput(
        interruptions_per_gpu_hour=lam,
        interruption_source=spec.source_for(num_gpus),
        mtbf_hours=mtbf,
        checkpoint_bytes=ckpt_bytes,
        storage_bandwidth_gb_per_s=bandwidth,
        storage_source=spec.storage_source
        if spec.storage_bandwidth_gb_per_s is None
        else "the experiment's goodput.storage_bandwidth_gb_per_s",
        checkpoint_write_s=c_s,
        young_daly_interval_hours=young,
        checkpoint_interval_hours=tau,
        restart_minutes=spec.restart_minutes,
        expected_interruptions=failures,
        checkpoint_hours=hours * c / tau if tau > 0 else 0.0,
        lost_work_hours=hours / mtbf * (tau / 2.0) if rate > 0 else 0.0,
        restart_hours=hours / mtbf * (r + c) if rate > 0 else 0.0,
        goodput=hours / wall if wall > 0 else 1.0,
        rule=RULE,
        num_gpus=num_gpus,
        failure_free_hours=hours,
        interval_costs=interval_costs(hours, num_gpus, ckpt_bytes, spec),
    )
