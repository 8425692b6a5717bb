"""A proxy trial starts without the Ray Train actors it does not need, and its workers import DeepSpeed
without MLflow; the production run keeps Ray Train's defaults. (Timed by benchmarks/proxy_overhead.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks import BackendSetupCallback
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from service.spec import Plan, load_experiment
from service.train.trainer import PROXY_RAY_TRAIN_ENV, build_trainer

ROOT = Path(__file__).resolve().parents[2]
PLAN = Plan(dp=2, zero_stage=1, micro_batch=2, grad_accum=1, precision="fp32")


def _trainer(tmp_path: Path, proxy: bool):
    experiment = load_experiment(ROOT / "experiments/tiny-cpu.yaml")
    return build_trainer(experiment, PLAN, run_name="t", storage_path=str(tmp_path), proxy=proxy)


def _kinds(trainer) -> set[type]:
    return {type(cb) for cb in trainer._create_default_callbacks()}


def test_proxy_trainer_drops_the_dataset_manager_and_placement_group_cleaner(tmp_path):
    proxy, production = _trainer(tmp_path, proxy=True), _trainer(tmp_path, proxy=False)
    assert isinstance(proxy, TorchTrainer) and type(production) is TorchTrainer
    # Ray's own list still has them (if Ray renames the hook or the classes, this fails, not the speed-up).
    assert {DatasetsCallback, PlacementGroupCleanerCallback, BackendSetupCallback} <= _kinds(production)
    assert BackendSetupCallback in _kinds(proxy)
    assert not {DatasetsCallback, PlacementGroupCleanerCallback} & _kinds(proxy)


def test_proxy_fit_turns_the_preemption_watcher_off_for_the_call_only(tmp_path, monkeypatch):
    seen: list[str | None] = []
    monkeypatch.setattr(TorchTrainer, "fit", lambda self: seen.append(os.environ.get(*PROXY_RAY_TRAIN_ENV)))
    (key,) = PROXY_RAY_TRAIN_ENV
    monkeypatch.delenv(key, raising=False)
    _trainer(tmp_path, proxy=True).fit()
    assert seen == ["0"] and key not in os.environ
    _trainer(tmp_path, proxy=False).fit()
    assert seen[-1] is None  # production: Ray's default (on)
    monkeypatch.setenv(key, "1")  # the user's value wins
    _trainer(tmp_path, proxy=True).fit()
    assert seen[-1] == "1" and os.environ[key] == "1"


@pytest.mark.slow
def test_worker_imports_deepspeed_without_mlflow():
    code = (
        "import sys; from service.train.startup import import_deepspeed; ds = import_deepspeed(); "
        "from deepspeed.autotuning import autotuner; "
        "print('RESULT', 'mlflow' in sys.modules, autotuner.has_mlflow, ds.__name__); "
        "import mlflow; print('RESULT ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    lines = [
        ln.split()[1:] for ln in out.stdout.splitlines() if ln.startswith("RESULT")
    ]  # DeepSpeed prints too
    assert lines == [["False", "False", "deepspeed"], ["ok"]]
