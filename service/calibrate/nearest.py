"""The fitted runs nearest a plan, with how far off the model was on each out of sample: the evidence
a reader weighs beside a number ("nearest published: IBM Llama-2-13B FSDP on H100, predicted +3.4 %").

Nearness, in this order of weight: the same software stack (service/spec/stack.py), the same GPU
type, a model of similar size, a similar GPU count. The distance is a stated sum, not a fit:
1 for another stack + 0.5 for another GPU + 0.25 per doubling of model size + 0.1 per doubling of
GPUs apart.
"""

from __future__ import annotations

import math

from service.spec.params import FitRun, ModelParams

STACK_WEIGHT = 1.0
GPU_WEIGHT = 0.5
SIZE_WEIGHT = 0.25  # per doubling of parameters
GPUS_WEIGHT = 0.1  # per doubling of GPU count


def distance(run: FitRun, stack: str, gpu: str, params_b: float, num_gpus: int) -> float:
    return (
        STACK_WEIGHT * (run.stack != stack)
        + GPU_WEIGHT * (run.gpu != gpu)
        + SIZE_WEIGHT * abs(math.log2(max(run.params_b, 1e-3) / max(params_b, 1e-3)))
        + GPUS_WEIGHT * abs(math.log2(run.num_gpus / num_gpus))
    )


def nearest_runs(
    params: ModelParams, stack: str, gpu: str, params_b: float, num_gpus: int, k: int = 3
) -> list[FitRun]:
    """The `k` fitted runs nearest (stack, gpu, model size, GPU count), nearest first, and the nearest
    run of the same engine when none of those is (its own engine's evidence, however old)."""
    ranked = sorted(params.runs, key=lambda r: distance(r, stack, gpu, params_b, num_gpus))
    top = ranked[:k]
    engine = stack.split()[0]
    if not any(r.stack.split()[0] == engine for r in top):
        top += [r for r in ranked if r.stack.split()[0] == engine][:1]
    return top


def describe(run: FitRun) -> str:
    """One line: what ran, and the model's out-of-sample error on it."""
    return (
        f"{run.source}: {run.model} ({run.params_b:.0f}B), {run.stack} on {run.num_gpus} × {run.gpu} "
        f"({run.plan}), predicted {run.error:+.1%}"
    )
