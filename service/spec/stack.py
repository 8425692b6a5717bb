"""The software stack a plan runs on, as the interval rule and the nearest-run lookup compare them.

A stack is the engine and the way it shards and communicates, in one precision:
DeepSpeed's ZeRO-3 with flat collectives (0.6 and later) is a different code path from its ZeRO-3
before 0.6 (`Workload.zero3_collectives`), from its ZeRO-0/1/2 and from its 3D engine (Megatron tensor
layers inside the PipelineEngine); FSDP with and without tensor / pipeline parallelism composed onto
it; Megatron. The GPU is kept apart (`gpu` below), so the rule can ask "this stack on this GPU".

Why it matters: the fitted parameters are shared by every stack, so a stack the fit never saw carries
whatever offset its kernels and runtime have (on runs kept outside the fit, NVIDIA-stack bf16 runs on
H100 and FSDP2 + TP runs on H200 were predicted about 20 % too slow as a group, while each source the
fit saw is within 15 %). `ModelParams.widening` widens the interval of an unseen stack-on-GPU pair.
"""

from __future__ import annotations

import numpy as np

from service.spec.plan_table import ENGINE_CODES, PRECISION_CODES, PlanTable


def stack_names(plans: PlanTable, legacy_zero3: bool = False, moe: bool = False) -> np.ndarray:
    """Per plan, its stack as a readable name, e.g. "DeepSpeed ZeRO-3, bf16" (object array); a
    mixture-of-experts model's runs are a stack of their own ("Megatron MoE, fp8"): their expert layers,
    router and all-to-alls are code the dense runs never ran."""
    engine = np.asarray(ENGINE_CODES, dtype=object)[plans.engine]
    split = (plans.tp > 1) | (plans.pp > 1)
    z3 = plans.zero_stage == 3
    deepspeed = np.select(
        [split, z3 & legacy_zero3, z3],
        ["DeepSpeed 3D", "DeepSpeed ZeRO-3 before 0.6", "DeepSpeed ZeRO-3"],
        "DeepSpeed ZeRO-0/1/2",
    )
    fsdp = np.where(split, "FSDP + TP/PP", "FSDP")
    megatron = np.where(plans.zero_stage >= 2, "Megatron-FSDP", "Megatron")
    name = np.select([engine == "deepspeed", engine == "fsdp"], [deepspeed, fsdp], megatron)
    precision = np.asarray(PRECISION_CODES, dtype=object)[plans.precision]
    kind = " MoE" if moe else ""
    return np.asarray([f"{n}{kind}, {p}" for n, p in zip(name, precision, strict=True)], dtype=object)


def on_gpu(stacks: np.ndarray, gpu_name: str) -> np.ndarray:
    """ "<stack> on <gpu>" keys, the pairs `Domain.stacks` records."""
    return np.asarray([f"{s} on {gpu_name}" for s in stacks], dtype=object)
