"""`launch.sh` of a `service train` job: it runs from the folder `run` ran in, and it asks for the
checkpoint and data to fine-tune rather than spend the run's budget training from random initialisation
(`SMOKE_TEST=1` for a short proof of the layout)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from service.design.outputs import offers_service_train, ray_job_command, write_launch_script
from service.spec import ClusterSpec, Plan

PLAN = Plan(dp=32, zero_stage=3, grad_accum=4)
CLUSTER = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)


def _script(tmp_path: Path) -> Path:
    command = ray_job_command("experiments/llama2-13b-32xh100.yaml", PLAN)
    return write_launch_script(
        tmp_path / "launch.sh", command, PLAN, CLUSTER, "deepspeed ...", train_job=True
    )


def _bash(script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("WEIGHTS", "DATA", "SMOKE_TEST")}
    return subprocess.run(
        ["bash", str(script)], env={**clean, **env}, capture_output=True, text=True, timeout=30
    )


def test_without_weights_or_a_smoke_test_it_refuses_in_one_line(tmp_path: Path) -> None:
    script = _script(tmp_path)
    assert f"cd {Path.cwd()}" in script.read_text()
    done = _bash(script)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "launch.sh: set WEIGHTS and DATA to fine-tune your checkpoint, or SMOKE_TEST=1 for a short run"
    )
    no_data = _bash(script, WEIGHTS="/ckpt")
    assert no_data.returncode != 0 and "set DATA to your training files" in no_data.stderr


def test_the_train_command_gets_the_weights_and_data_or_a_short_run(tmp_path: Path) -> None:
    """With `python` shadowed by an echo, the script prints the command it would submit."""
    script = _script(tmp_path)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text('#!/usr/bin/env bash\necho "$@"\n')
    (fake / "python").chmod(0o755)
    path = f"{fake}:{os.environ['PATH']}"
    tune = _bash(script, PATH=path, WEIGHTS="/ckpt", DATA="/data/*.jsonl")
    assert tune.returncode == 0, tune.stderr
    assert tune.stdout.strip().endswith(f"--plan {PLAN.short()} --weights /ckpt --data /data/*.jsonl")
    smoke = _bash(script, PATH=path, SMOKE_TEST="1")
    assert smoke.returncode == 0 and smoke.stdout.strip().endswith("--steps 20")


def test_a_fused_loss_workload_is_launched_with_the_users_own_script() -> None:
    """`service train` keeps the logits and refuses a workload priced with a fused loss, so `run` offers
    it only for the experiment's own cluster and a materialised loss; otherwise the DeepSpeed command."""
    from service.spec import load_experiment

    seed = load_experiment(Path(__file__).resolve().parents[2] / "experiments" / "llama2-13b-32xh100.yaml")
    fused = seed.model_copy(
        update={"workload": seed.workload.model_copy(update={"fused_cross_entropy": True})}
    )
    plan = Plan(dp=32, zero_stage=3, micro_batch=1, grad_accum=4)
    assert offers_service_train(seed, seed.cluster, "experiments/llama2-13b-32xh100.yaml", plan)
    assert not offers_service_train(fused, fused.cluster, "experiments/llama2-13b-32xh100.yaml", plan)
    assert not offers_service_train(seed, seed.cluster, None, plan)
