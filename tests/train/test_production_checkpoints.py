"""How often `service train` checkpoints when not told: Young's interval (the memo's goodput section)
over the cost model's step time for the plan, capped at the run's length."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from service.catalog import load_model
from service.costmodel.estimate import estimate
from service.spec import load_experiment
from service.spec.production import LLAMA3_RATE_PER_GPU_HOUR, SMALL_CLUSTER_RATE_PER_GPU_HOUR
from service.train.production import ProductionRun

SEED = "experiments/llama2-13b-32xh100.yaml"
PLAN = "dp16-tp2-pp1-z1-mb2-ga4-rc:none-sp"


def _young_daly_steps(path, rate: float, steps: int) -> int:
    """Written from the formula: τ = sqrt(2·C·M), C = 14 B/param ÷ (2 TB/s ÷ 16,384 GPUs · 32), M = 1/(λ·32).
    (The storage rate is Llama 3's 2 TB/s over its 16,384 GPUs, 0.1220703 GB/s per GPU: rounded to
    0.122 it moved the floor of τ / step by one step.)"""
    spec = load_experiment(path)
    ckpt_s = 14 * load_model("llama2-13b").num_params / (2e12 / 16384 * 32)
    tau_s = math.sqrt(2 * ckpt_s * 3600 / (rate * 32))
    run = ProductionRun(spec, PLAN, track=False)
    step_s = estimate(spec.model, spec.cluster, run.plan, spec.workload).step_time_s
    return max(1, min(steps, int(tau_s // step_s)))


def test_default_interval_is_young_daly_over_the_predicted_step(tmp_path):
    run = ProductionRun(SEED, PLAN, track=False)
    assert run.steps == 3814  # 2 B tokens ÷ 128 × 4,096 tokens per step
    # 32 GPUs get the small-cluster rate (Kokolis et al. 2024): Young's interval (2.7 h) falls inside
    # the 3.9 h run, so one checkpoint on the way and one at the end.
    expected = _young_daly_steps(SEED, SMALL_CLUSTER_RATE_PER_GPU_HOUR, run.steps)
    assert run.checkpoint_every == expected and run.steps / 2 < expected < run.steps
    data = yaml.safe_load(Path(SEED).read_text())
    data["goodput"] = {"interruptions_per_gpu_hour": LLAMA3_RATE_PER_GPU_HOUR}  # Llama 3's fleet rate:
    fleet_rate = tmp_path / "fleet.yaml"  # Young's interval (6.4 h) outlasts the run, so only the end
    fleet_rate.write_text(yaml.safe_dump(data))
    fleet = ProductionRun(fleet_rate, PLAN, track=False)
    assert (
        fleet.checkpoint_every
        == fleet.steps
        == _young_daly_steps(fleet_rate, LLAMA3_RATE_PER_GPU_HOUR, fleet.steps)
    )
    data["goodput"] = {"interruptions_per_gpu_hour": 1e-3}  # 9× the default: several checkpoints
    path = tmp_path / "flaky.yaml"
    path.write_text(yaml.safe_dump(data))
    flaky = ProductionRun(path, PLAN, track=False)
    expected = _young_daly_steps(path, 1e-3, flaky.steps)
    assert flaky.checkpoint_every == expected and 1 < expected < flaky.steps / 3
    assert ProductionRun(path, PLAN, track=False, checkpoint_every=7).checkpoint_every == 7
