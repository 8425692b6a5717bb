"""A GPU resource with no CUDA device behind it (Ray's fake multinode provider): the worker runs on
CPU and gloo, and the trainer makes a NCCL group only where every worker has CUDA. A real trial on fake
GPUs reporting the fallback is tests/cluster/test_autoscaling.py's (its GPU nodes have no CUDA)."""

from __future__ import annotations

import pytest

from service.spec import Plan, load_experiment
from service.train.device import GPU_FALLBACK, DeviceChoice, choose_device


@pytest.mark.parametrize(
    ("requested", "gpu_ids", "cuda", "expected"),
    [
        ("cuda", [0], True, DeviceChoice("cuda", "nccl")),
        ("cuda", [], True, DeviceChoice("cuda", "nccl")),  # torchrun: no Ray, CUDA there
        ("cuda", [0], False, DeviceChoice("cpu", "gloo", GPU_FALLBACK)),  # fake GPU
        ("cuda", [], False, DeviceChoice("cpu", "gloo", GPU_FALLBACK)),
        ("cpu", [1], False, DeviceChoice("cpu", "gloo", GPU_FALLBACK)),  # a GPU resource, no CUDA
        ("cpu", [1], True, DeviceChoice("cpu", "gloo")),  # a CPU experiment stays on CPU
        ("cpu", [], False, DeviceChoice("cpu", "gloo")),
    ],
)
def test_choose_device(requested, gpu_ids, cuda, expected):
    assert choose_device(requested, gpu_ids, cuda) == expected


@pytest.mark.parametrize(("cuda_by_worker", "backend"), [([True, True], "nccl"), ([True, False], "gloo")])
def test_gpu_trainer_makes_a_nccl_group_only_when_every_worker_has_cuda(
    tmp_path, monkeypatch, cuda_by_worker, backend
):
    from ray.train.torch.config import _TorchBackend

    from service.train.trainer import build_trainer

    exp = load_experiment("experiments/tiny-cpu.yaml")
    exp = exp.model_copy(update={"proxy": exp.proxy.model_copy(update={"device": "cuda"})})
    plan = Plan(dp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32")
    trainer = build_trainer(exp, plan, run_name="t", storage_path=str(tmp_path))
    assert trainer.scaling_config.use_gpu
    made = []
    monkeypatch.setattr(_TorchBackend, "on_start", lambda self, group, config: made.append(config))

    class Workers:  # what the backend asks before Ray Train makes the process group
        def execute(self, fn):
            return cuda_by_worker

    trainer.backend_config.backend_cls().on_start(Workers(), trainer.backend_config)
    assert [c.backend for c in made] == [backend]
    assert made[0].timeout_s == trainer.backend_config.timeout_s
