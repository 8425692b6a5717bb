"""Synthetic measured runs: the cost model itself, under known parameters, with seeded noise."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from service.calibrate import MeasuredRun, predict_runs
from service.catalog import load_model
from service.spec import ClusterSpec, Plan, Workload
from service.spec.entries import load_gpu
from service.spec.params import ModelParams

LAYOUTS = [
    dict(zero_stage=3, micro_batch=1, grad_accum=1, recompute="full"),
    dict(zero_stage=3, micro_batch=2, grad_accum=2, recompute="none"),
    dict(zero_stage=1, micro_batch=1, grad_accum=8, recompute="selective"),
    dict(zero_stage=2, micro_batch=4, grad_accum=1, recompute="full"),
]


def synthetic_runs(
    truth: ModelParams, per_source: int, sources: int = 3, noise: float = 0.03, seed: int = 0
) -> list[MeasuredRun]:
    """`sources` × `per_source` runs of Llama 2 7B/13B on 8-128 H100/A100s, measured as the cost model
    predicts them under `truth`, times lognormal noise of `noise`."""
    rng = np.random.default_rng(seed)
    grid = list(
        itertools.product(
            ("llama2-7b", "llama2-13b"),
            ("h100-sxm-80gb", "a100-sxm-80gb"),
            (1, 4, 16),
            (2048, 4096),
            range(len(LAYOUTS)),
        )
    )
    order = rng.permutation(len(grid))
    runs = []
    for i in range(sources * per_source):
        model_name, gpu, nodes, seq, layout = grid[order[i % len(grid)]]
        # 100 Gb/s per GPU across nodes (a RoCE cloud, like fms-fsdp's H100s): the collectives then show
        # in the step time, so the inter-node efficiency is identifiable from a few runs.
        spec = load_gpu(gpu).model_copy(update={"inter_node_bandwidth_gb_per_s": 12.5})
        cluster = ClusterSpec(gpu=spec, num_nodes=nodes)
        plan = Plan(dp=cluster.num_gpus, **LAYOUTS[layout])
        workload = Workload(
            seq_len=seq,
            global_batch_sequences=plan.micro_batch * plan.grad_accum * plan.dp,
            tokens_to_train=1e9,
        )
        run = MeasuredRun(
            id=f"run{i}",
            source=f"source{i % sources}",
            model=load_model(model_name),
            cluster=cluster,
            workload=workload,
            plan=plan,
            tokens_per_s_per_gpu=1.0,
        )
        runs.append(run)
    true = predict_runs(runs, truth) * np.exp(rng.normal(0.0, noise, len(runs)))
    return [r.model_copy(update={"tokens_per_s_per_gpu": float(t)}) for r, t in zip(runs, true, strict=True)]


@pytest.fixture
def truth() -> ModelParams:
    return ModelParams().with_values(
        {"gemm_efficiency_scale": 0.85, "step_overhead_s": 0.4, "inter_node_bus_efficiency": 0.6}
    )
