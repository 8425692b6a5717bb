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


def test_service_train_runs_the_config_run_writes(tmp_path) -> None:
    """`launch.sh` runs `service train`, whose workers build their own DeepSpeed config: it is the written
    ds_config.json's (the experiment's learning rate and schedule, overlap on), not the proxies' (a
    3e-4 constant rate with overlap off), except for the schedule's length, which is the run's steps."""
    from service.train.ds_config import deepspeed_config, with_settings
    from service.train.production import ProductionRun
    from service.train.trainer import worker_config

    spec = load_experiment(REPO / "experiments/llama2-13b-32xh100.yaml")
    run = ProductionRun(spec, PLAN, track=False)
    cfg = worker_config(run.experiment, run.plan, run_dir=str(tmp_path), steps=run.steps)
    cfg = cfg.model_copy(update={"ds_settings": run.ds_settings})
    runs = with_settings(deepspeed_config(cfg.plan, cfg.proxy, cfg.model), cfg.ds_settings)  # build_engine's
    written = production_ds_config(run.plan, spec)
    assert runs == written and runs["optimizer"]["params"]["lr"] == 2e-5
    assert runs["zero_optimization"]["overlap_comm"] is True and runs["scheduler"]["type"] == "WarmupCosineLR"
    shorter = ProductionRun(spec, PLAN, track=False, steps=100).ds_settings
    assert shorter["scheduler"]["params"]["total_num_steps"] == 100


def test_offload_buffers_are_pinned_on_gpus_as_the_cost_model_prices_them() -> None:
    from service.spec.proxy import ProxySpec
    from service.train.ds_config import deepspeed_config

    spec = load_experiment(REPO / "experiments/llama2-13b-32xh100.yaml")
    plan = Plan(dp=32, zero_stage=3, offload_optimizer=True, offload_params=True, micro_batch=1, grad_accum=4)
    zero = production_ds_config(plan, spec)["zero_optimization"]
    assert zero["offload_optimizer"]["pin_memory"] is True and zero["offload_param"]["pin_memory"] is True
    cpu = deepspeed_config(plan, ProxySpec(device="cpu"), spec.model)["zero_optimization"]
    assert cpu["offload_optimizer"]["pin_memory"] is False  # a CPU proxy has no device to pin for


def test_an_fp8_plan_keeps_deepspeeds_bf16_around_its_fp8_gemms() -> None:
    spec = load_experiment(REPO / "experiments/llama2-13b-32xh100.yaml")
    config = production_ds_config(PLAN.model_copy(update={"precision": "fp8"}), spec)
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False


def test_a_layout_the_trainer_cannot_build_is_launched_with_the_users_script(tmp_path) -> None:
    """Qwen3-30B-A3B's choice splits sequences over cp 2: the trainer's MoE model has no Ulysses
    attention beside DeepSpeed's MoE layer, so `service train` refuses it in one line and `run`'s
    launch is the user's own script; a MoE plan it can build gets a smoke test only (no MoE checkpoint
    loads)."""
    import subprocess

    from service.design.outputs import offers_service_train, write_launch_script
    from service.spec import SpecError
    from service.train.production import ProductionRun

    spec = load_experiment(REPO / "experiments/qwen3-30b-a3b-64xh100.yaml")
    cp2 = Plan(dp=32, cp=2, ep=8, zero_stage=1, micro_batch=1, grad_accum=16)
    with pytest.raises(SpecError, match=r"--plan: .*cp: 2 with MoE blocks.*your own script") as err:
        ProductionRun(spec, cp2, track=False)
    assert "\n" not in str(err.value)
    assert not offers_service_train(spec, spec.cluster, "exp.yaml", cp2)
    runnable = Plan(dp=64, ep=8, zero_stage=1, micro_batch=1, grad_accum=8)
    assert offers_service_train(spec, spec.cluster, "exp.yaml", runnable)
    script = write_launch_script(
        tmp_path / "launch.sh", "python -m service train exp.yaml", runnable, spec.cluster,
        "deepspeed train.py", spec.model, train_job=True,
    )  # fmt: skip
    text = script.read_text()
    assert "WEIGHTS" not in text and "SMOKE_TEST" in text and "loads no mixture-of-experts checkpoint" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    refused = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode == 2 and "SMOKE_TEST=1" in refused.stderr
