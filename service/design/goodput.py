"""The memo's goodput record: the numbers behind the expected wall-clock for the selected plan
(service/costmodel/goodput.py has the rule and its sources), and the cost of checkpointing more often:
W at τ = 1 h, 30 min and 15 min (those shorter than the run), against W at the optimum. τ = sqrt(2·C·M)
minimises C/τ + τ/(2M), so every other interval costs more.
"""

from __future__ import annotations

import numpy as np

from service.costmodel.goodput import RULE, wall_at_interval, wall_hours, write_hours
from service.report.decision_records import Goodput, IntervalCost
from service.spec.production import GoodputSpec

# The intervals the memo prices against the optimum: (label, hours).
SHORTER_INTERVALS = (("1 h", 1.0), ("30 min", 0.5), ("15 min", 0.25))


def interval_costs(hours: float, num_gpus: int, ckpt_bytes: float, spec: GoodputSpec) -> list[IntervalCost]:
    """The optimum's expected wall-clock (as `wall_hours`), then that of a checkpoint every 1 h, 30 min
    and 15 min — those shorter than the run, other than the optimum itself — with their extra over it."""
    rate = spec.rate_per_gpu_hour(num_gpus) * num_gpus
    c = write_hours(num_gpus, ckpt_bytes, spec)
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
