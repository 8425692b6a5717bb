"""`build_trainer`: a Ray Train (V2) `TorchTrainer` that runs one plan at proxy scale.

A trainer with the same `run_name` and `storage_path` as an earlier one resumes from that run's latest
checkpoint (Ray Train V2 keeps the checkpoint list in the run's storage folder), and a worker that dies
is restarted from the latest checkpoint up to `max_failures` times.

Example:
    >>> trainer = build_trainer(load_experiment("experiments/tiny-cpu.yaml"),
    ...                         Plan(dp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32"),
    ...                         run_name="z1", storage_path="/tmp/proxy")  # doctest: +SKIP
    >>> trainer.fit()  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan
from service.spec.record import PREDICTED
from service.train.proxy_scale import predict_proxy, proxy_model, proxy_plan, proxy_seq_len
from service.train.worker import WorkerConfig, train_loop_per_worker


def worker_config(
    experiment: ExperimentSpec,
    plan: Plan,
    *,
    run_dir: str,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    inject_failure_at_step: int | None = None,
    predicted: dict[str, float] | None = None,
    stall: dict[str, float] | None = None,
    save_final: bool = False,
) -> WorkerConfig:
    """What every worker of the trial receives (also what the torchrun launcher reads)."""
    proxy = experiment.proxy
    return WorkerConfig(
        model=proxy_model(experiment),
        plan=proxy_plan(experiment, plan),
        proxy=proxy,
        seq_len=proxy_seq_len(experiment),
        steps=steps or proxy.steps,
        checkpoint_every=proxy.checkpoint_every if checkpoint_every is None else checkpoint_every,
        save_final=save_final,
        inject_failure_at_step=inject_failure_at_step,
        run_dir=run_dir,
        predicted=predicted if predicted is not None else _prediction_or_empty(experiment, plan),
        stall=stall,
    )


def trial_config(experiment: ExperimentSpec, plan: Plan, *, run_dir: Path, **options: Any) -> WorkerConfig:
    """`worker_config` for a trial whose step log and markers go to `run_dir` (made here), whoever
    launches its workers (`build_trainer`, or `run_proxy`'s `launch`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return worker_config(experiment, plan, run_dir=str(run_dir), **options)


def _prediction_or_empty(experiment: ExperimentSpec, plan: Plan) -> dict[str, float]:
    """The cost model's numbers under the names the worker reports them (`predicted_x`: the Ray
    boundary); NaN for each when it cannot predict this plan (the run still goes on)."""
    try:
        return predict_proxy(experiment, plan).prefixed(PREDICTED)
    except Exception:  # a prediction is a side-by-side, never a reason to skip a measurement
        from service.train.proxy_scale import PREDICTED_QUANTITIES

        return {PREDICTED + q: math.nan for q in PREDICTED_QUANTITIES}


# Ray Train V2's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default 2 s) and
# each worker's result queue holds one report, so a worker reporting every step blocks in
# `ray.train.report` until the next poll: steps shorter than 2 s would run at one per 2 s. Proxy steps
# are often sub-second; 0.1 s polls cost the controller little. A value the user set is kept.
CONTROLLER_POLL_INTERVAL_S = 0.1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def _device_aware_config_class() -> Any:
    """`TorchConfig` whose backend asks the workers (see `device_aware_torch_config`); made once."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class _DeviceAwareBackend(_TorchBackend):  # type: ignore[misc]
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            backend = "nccl" if all(worker_group.execute(_cuda_available)) else "gloo"
            super().on_start(worker_group, dataclasses.replace(backend_config, backend=backend))

    @dataclasses.dataclass
    class DeviceAwareTorchConfig(TorchConfig):  # type: ignore[misc]
        @property
        def backend_cls(self) -> Any:
            return _DeviceAwareBackend

    return DeviceAwareTorchConfig


def device_aware_torch_config(timeout_s: int) -> Any:
    """A `TorchConfig` for GPU workers whose process group is nccl only when every worker has CUDA.

    Ray Train makes the process group before the worker code runs (`_TorchBackend.on_start` in
    ray/train/torch/config.py, Ray 2.60), with nccl when the workers hold GPU resources. A GPU
    resource with no CUDA device behind it (Ray's fake multinode provider) would fail there, before
    the worker could fall back to CPU. The driver cannot tell (its node may have no GPU while the
    workers' do), so the backend asks each worker for `torch.cuda.is_available()` first, and uses
    gloo unless all say yes; the worker then runs on CPU (`device.pick_device`) and reports why.
    """
    return _device_aware_config_class()(backend="nccl", timeout_s=timeout_s)


# What a proxy trial does without (each is a Ray actor, i.e. a fresh Python process importing Ray Train,
# 2-4 s of CPU at a trial's start on a 2-core machine, where a trial's start-up is CPU-bound):
# - the dataset manager: Ray Train V2 starts one even with no `datasets` (DatasetsCallback); the
#   workers read their own token shards (train/data.py) and never call `get_dataset_shard`;
# - the placement-group cleaner (a detached actor per run): it removes the workers' placement group
#   if the controller dies; a non-detached placement group is already removed with its creator, and
#   the search frees stopped trials' groups itself (search/stopping.py);
# - the preemption watcher (observability of spot-node preemption notices): a proxy lost to a
#   preemption is a failed trial either way. It is the controller's, so it is turned off through the
#   environment Ray Train propagates to it (RAY_TRAIN_ENABLE_PREEMPTION_WATCHER, read by
#   ray/train/v2/_internal/execution/controller/controller.py).
# The production run keeps all three.
PROXY_RAY_TRAIN_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


@functools.cache
def _proxy_trainer_class() -> Any:
    """`TorchTrainer` without the dataset manager and placement-group cleaner (see above); made once.

    `_create_default_callbacks` is Ray Train V2's private hook (ray/train/v2/api/data_parallel_trainer.py,
    Ray 2.60); tests/train/test_trainer_lean.py fails if it stops being what is overridden here.
    """
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class ProxyTorchTrainer(TorchTrainer):  # type: ignore[misc]
        def _create_default_callbacks(self) -> list[Any]:
            dropped: tuple[type, ...] = (PlacementGroupCleanerCallback,)
            if not self.datasets:
                dropped += (DatasetsCallback,)
            defaults = super()._create_default_callbacks()  # type: ignore[misc]
            return [cb for cb in defaults if not isinstance(cb, dropped)]

        def fit(self) -> Any:
            # The controller is made inside fit() with this process's Ray Train variables; set for
            # the call only (a value the user set is kept), so a production run later in the same
            # process keeps its watcher.
            added = {k: v for k, v in PROXY_RAY_TRAIN_ENV.items() if k not in os.environ}
            os.environ.update(added)
            try:
                return super().fit()
            finally:
                for key in added:
                    os.environ.pop(key, None)

    return ProxyTorchTrainer


def build_trainer(
    experiment: ExperimentSpec,
    plan: Plan,
    *,
    run_name: str,
    storage_path: str,
    steps: int | None = None,
    checkpoint_every: int | None = None,
    inject_failure_at_step: int | None = None,
    max_failures: int = 0,
    callbacks: Sequence[Any] = (),
    stall: dict[str, float] | None = None,
    proxy: bool = True,
) -> Any:
    """A `TorchTrainer` with `plan.num_gpus` workers running `train_loop_per_worker`.

    Args:
        experiment: the experiment; its `proxy` section sets the scale, device and limits.
        plan: the layout to run (dp·tp·pp workers).
        run_name, storage_path: where Ray Train keeps checkpoints; the same pair resumes.
        steps: optimizer steps (default `proxy.steps`).
        checkpoint_every: save every K steps (default `proxy.checkpoint_every`; 0 = never).
        inject_failure_at_step: kill one worker once at this step (a marker file makes it once).
        max_failures: restarts from the latest checkpoint that Ray Train may make.
        callbacks: Ray Train `UserCallback`s (e.g. Tune's `TuneReportCallback`).
        stall: test hook, see `WorkerConfig.stall`.
        proxy: a proxy trial, started without the Ray Train actors it does not need (see
            `PROXY_RAY_TRAIN_ENV`); False for the production run, which also checkpoints after its
            last step (the trained weights).
    """
    config = trial_config(
        experiment,
        plan,
        run_dir=Path(storage_path) / run_name,
        steps=steps,
        checkpoint_every=checkpoint_every,
        inject_failure_at_step=inject_failure_at_step,
        stall=stall,
        save_final=not proxy,
    )
    return ray_trainer(
        experiment,
        config,
        plan.num_gpus,
        run_name=run_name,
        storage_path=storage_path,
        max_failures=max_failures,
        callbacks=callbacks,
        proxy=proxy,
    )


def ray_trainer(
    experiment: ExperimentSpec,
    config: WorkerConfig,
    workers: int,
    *,
    run_name: str,
    storage_path: str,
    max_failures: int = 0,
    callbacks: Sequence[Any] = (),
    proxy: bool = True,
) -> Any:
    """The `TorchTrainer` of `build_trainer` for a worker config already made (`trial_config`)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(CONTROLLER_POLL_INTERVAL_S))
    use_gpu = experiment.proxy.device == "cuda"
    timeout_s = max(1, math.ceil(experiment.proxy.collective_timeout_s))
    trainer_class = _proxy_trainer_class() if proxy else TorchTrainer
    return trainer_class(
        train_loop_per_worker,
        train_loop_config=config.model_dump(mode="json"),
        torch_config=device_aware_torch_config(timeout_s)
        if use_gpu
        else TorchConfig("gloo", timeout_s=timeout_s),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            callbacks=list(callbacks),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
