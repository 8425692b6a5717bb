"""A proxy trial starts without the Ray Train actors it does not need, and its workers import DeepSpeed
without MLflow and build its engine without its Muon modules; the production run keeps Ray Train's
defaults. (Timed by benchmarks/proxy_overhead.py.)"""

from __future__ import annotations

import json
import math
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


WORKER_WITHOUT_MUON = """
import json, sys
from service.train.worker import run_worker
losses = []
run_worker(json.loads(open(sys.argv[1]).read()), lambda metrics, _: losses.append(metrics["loss"]))
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
from deepspeed.runtime.zero.muon.original_muon import muon_update
try:
    MuonWithAuxAdam()
    built = "built"
except RuntimeError as e:
    built = "refused" if "not loaded" in str(e) else repr(e)
print("RESULT", json.dumps({"losses": losses, "inductor": "torch._inductor.compile_fx" in sys.modules,
                            "built": built, "update": muon_update.__module__}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_worker_trains_without_importing_deepspeeds_muon(tmp_path, zero_stage):
    """DeepSpeed's ZeRO optimizers import its Muon modules (and through them torch._inductor, ~1.4 s of
    CPU) on every engine and gradient flattening; the worker's stand-ins answer "not Muon" without it,
    the plan still trains, and the stand-in refuses to be used as an optimizer."""
    from service.cluster.ports import free_port
    from service.train.trainer import worker_config

    experiment = load_experiment(ROOT / "experiments/tiny-cpu.yaml")
    plan = Plan(dp=1, zero_stage=zero_stage, micro_batch=2, grad_accum=2, precision="fp32")
    cfg = worker_config(experiment, plan, run_dir=str(tmp_path), steps=3, checkpoint_every=0, predicted={})
    (tmp_path / "config.json").write_text(cfg.model_dump_json())
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    # A free port: the other xdist stream may run gloo groups too.
    env |= {"MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER_WITHOUT_MUON, str(tmp_path / "config.json")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
    assert result["inductor"] is False
    assert result["built"] == "refused"
    assert result["update"] == "service.train.startup"
