"""Goodput: the wall-clock a run really takes once interruptions, checkpoints and restarts are paid.

The math, vectorised over plans (`wall_hours`, `with_goodput`); the memo's record of it is
service/design/goodput.py.

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
"""

from __future__ import annotations

import numpy as np

from service.costmodel.result import EstimateTable
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.production import GoodputSpec, checkpoint_bytes

RULE = (
    "W = H·(1 + C/τ + (τ/2 + R + C)/M), τ = min(sqrt(2·C·M), H) (Young/Daly); M = 1/(λ·N); "
    "C = checkpoint bytes / storage bandwidth; R = restart time"
)


def write_hours(num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> float:
    """C: hours to write one checkpoint at the storage's aggregate bandwidth."""
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
    c = write_hours(num_gpus, ckpt_bytes, spec)
    tau = np.minimum(np.sqrt(2.0 * c * mtbf), np.maximum(h, 1e-9))
    r = spec.restart_minutes / 60.0
    return h * (1.0 + c / tau + (tau / 2.0 + r + c) / mtbf)


def with_goodput(
    est: EstimateTable, model: ModelSpec, cluster: ClusterSpec, precision: str, goodput: GoodputSpec
) -> EstimateTable:
    """`est` with hours and dollars (and their intervals) scaled to the expected wall-clock."""
    from dataclasses import replace

    ckpt = checkpoint_bytes(model, precision)
    wall = wall_hours(est.hours, cluster.num_gpus, ckpt, goodput)
    factor = np.where(est.hours > 0, wall / np.maximum(est.hours, 1e-12), 1.0)
    return replace(
        est,
        hours=est.hours * factor,
        dollars=est.dollars * factor,
        hours_low=est.hours_low * factor,
        hours_high=est.hours_high * factor,
        dollars_low=est.dollars_low * factor,
        dollars_high=est.dollars_high * factor,
    )
