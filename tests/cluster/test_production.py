"""`python -m service train` (ProductionRun): the tiny experiment at its own full scale (4 layers, 2
workers) with a plan picked by label; one worker is killed mid-run (the worker's own failure hook:
`os._exit` at a step), Ray Train restarts from the latest checkpoint, and the loss trajectory is
bitwise the one of an uninterrupted run (run on the tests' local worker processes,
tests/train/local_workers.py: the same worker loop, no Ray). The driver logged every step's loss to
MLflow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PLAN = "dp2-tp1-pp1-z1-mb4-ga1-rc:none"
STEPS = 4


@pytest.mark.slow
def test_killed_worker_resumes_and_the_loss_trajectory_is_bitwise(tmp_path: Path, monkeypatch):
    from mlflow import MlflowClient

    from service.train.production import ProductionRun
    from tests.train import local_workers

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    common = {"plan": PLAN, "steps": STEPS, "storage_path": tmp_path / "runs", "checkpoint_every": 1}
    reference = ProductionRun(
        "experiments/tiny-cpu.yaml", run_name="reference", launch=local_workers.launch, **common
    ).fit()
    assert reference.status == "ok" and reference.restarts == 0, reference.reason
    resumed = ProductionRun(
        "experiments/tiny-cpu.yaml", run_name="killed", max_failures=1, inject_failure_at_step=3, **common
    ).fit()
    assert resumed.status == "ok", resumed.reason
    assert resumed.restarts == 1 and (Path(resumed.run_dir) / "injected_failure.done").exists()
    # Ray Train kept DeepSpeed's checkpoints, its last step's among them (tag step<N>).
    tags = {p.name for p in (tmp_path / "runs" / "killed").rglob("step*") if p.is_dir()}
    assert f"step{STEPS}" in tags, sorted(tags)
    assert len(reference.losses) == STEPS
    assert resumed.losses == reference.losses  # bitwise: float equality, not approx

    history = MlflowClient(tracking_uri=store).get_metric_history(resumed.mlflow_run_id, "loss")
    by_step = {m.step: m.value for m in history}
    assert [by_step[s] for s in range(1, STEPS + 1)] == resumed.losses
    run = MlflowClient(tracking_uri=store).get_run(resumed.mlflow_run_id)
    assert run.data.params["plan"] == PLAN and run.info.status == "FINISHED"


def test_a_fused_loss_experiment_is_refused_by_this_services_trainer():
    """Liger's fused cross-entropy prices no logits; this service's worker keeps them, so `train` (and
    `preflight`, which runs the same worker) refuses before anything starts, naming the field."""
    from manifest_checks import ROOT

    from service.spec import SpecError, load_experiment
    from service.train.production import ProductionRun

    tiny = load_experiment(ROOT / "experiments" / "tiny-cpu.yaml")
    workload = tiny.workload.model_copy(update={"fused_cross_entropy": True})
    fused = tiny.model_copy(update={"workload": workload})
    with pytest.raises(SpecError) as err:
        ProductionRun(fused, steps=1, track=False)
    assert err.value.field == "workload.fused_cross_entropy" and "materialised logits" in str(err.value)


def test_unknown_plan_label_is_one_line():
    import subprocess
    import sys

    from manifest_checks import ROOT

    proc = subprocess.run([sys.executable, "-m", "service", "train", "experiments/tiny-cpu.yaml", "--plan",
                           "dp9-nope"], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (
        proc.returncode == 2
        and proc.stderr.count("\n") == 1
        and "'dp9-nope' is not a valid plan" in proc.stderr
    )


@pytest.mark.slow
def test_a_run_the_local_ray_has_too_few_gpus_for_is_refused_not_left_waiting(tmp_path: Path):
    import os
    import re
    import subprocess
    import sys

    from manifest_checks import ROOT

    cmd = [sys.executable, "-m", "service", "train", "experiments/llama2-13b-32xh100.yaml", "--plan",
           "dp16-tp2-pp1-z1-mb2-ga4-rc:none-sp", "--storage-path", str(tmp_path), "--json"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"needs 32 GPUs and the local Ray started here has \d+", errors[0])
