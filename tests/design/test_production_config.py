"""The DeepSpeed config `run` ships for the seed: DeepSpeed's own parser takes it with the plan's data-
parallel size, and its warmup-cosine schedule, built by DeepSpeed, follows the experiment's optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from service.design.outputs import production_ds_config
from service.spec import load_experiment
from service.spec.plan import Plan

REPO = Path(__file__).resolve().parents[2]
PLAN = Plan(dp=16, tp=2, sequence_parallel=True, zero_stage=1, micro_batch=2, grad_accum=4)


class _DataParallel:
    """The `mpu` a tensor-parallel train.py passes: DeepSpeed reads its data-parallel size from it."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def test_deepspeed_parses_the_config_with_the_plans_data_parallel_size(monkeypatch) -> None:
    from deepspeed.runtime import config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)  # no process group in a unit test
    config = production_ds_config(PLAN, load_experiment(REPO / "experiments/llama2-13b-32xh100.yaml"))
    parsed = ds_config.DeepSpeedConfig(config, mpu=_DataParallel(16))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu) == (128, 2)
    assert parsed.gradient_accumulation_steps == 4 and parsed.zero_optimization_stage == 1
    assert parsed.scheduler_name == "WarmupCosineLR"
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        ds_config.DeepSpeedConfig(config, mpu=_DataParallel(32))  # a train.py without the TP groups


def test_the_schedule_warms_up_to_the_experiments_rate_and_decays_to_its_floor() -> None:
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    spec = load_experiment(REPO / "experiments/llama2-13b-32xh100.yaml")
    config = production_ds_config(PLAN, spec)
    assert config["optimizer"]["params"]["lr"] == spec.optimizer.lr == 2e-5
    params = config["scheduler"]["params"]
    assert params["total_num_steps"] == 3814 and params["warmup_num_steps"] == round(0.03 * 3814)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=spec.optimizer.lr)
    schedule = WarmupCosineLR(optimizer, **params)
    rates = []
    for _ in range(params["total_num_steps"]):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates[0] < 0.05 * spec.optimizer.lr  # warms up from (almost) zero
    assert max(rates) == pytest.approx(spec.optimizer.lr, rel=0.01)
    assert rates[-1] == pytest.approx(spec.optimizer.min_lr_ratio * spec.optimizer.lr, rel=0.05)
