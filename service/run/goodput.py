"""Goodput: the wall-clock a run really takes once interruptions, checkpoints and restarts are paid.

- Interruptions arrive at `λ` per GPU-hour (default: Llama 3's 419 in 54 days on 16,384 H100s), so
  the job's mean time between failures is M = 1 / (λ · N).
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

from service.report.result import Goodput
from service.spec.production import GoodputSpec, checkpoint_bytes

__all__ = ["RULE", "checkpoint_bytes", "goodput_record", "wall_hours"]

RULE = (
    "W = H·(1 + C/τ + (τ/2 + R + C)/M), τ = min(sqrt(2·C·M), H) (Young/Daly); M = 1/(λ·N); "
    "C = checkpoint bytes / storage bandwidth; R = restart time"
)


def wall_hours(hours: np.ndarray, num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> np.ndarray:
    """Expected wall-clock hours for failure-free `hours` (vectorised over plans)."""
    h = np.asarray(hours, dtype=float)
    rate = spec.interruptions_per_gpu_hour * num_gpus
    if rate <= 0:
        return h.copy()
    mtbf = 1.0 / rate
    c = ckpt_bytes / (spec.bandwidth_gb_per_s(num_gpus) * 1e9) / 3600.0
    tau = np.minimum(np.sqrt(2.0 * c * mtbf), np.maximum(h, 1e-9))
    r = spec.restart_minutes / 60.0
    return h * (1.0 + c / tau + (tau / 2.0 + r + c) / mtbf)


def goodput_record(hours: float, num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> Goodput:
    """The numbers behind `wall_hours` for one plan, for the memo."""
    rate = spec.interruptions_per_gpu_hour * num_gpus
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
        interruptions_per_gpu_hour=spec.interruptions_per_gpu_hour,
        interruption_source=spec.interruption_source,
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
    )
