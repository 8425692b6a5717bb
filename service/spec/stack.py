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

from dataclasses import dataclass

import numpy as np

from service.spec.plan_table import ENGINE_CODES, PRECISION_CODES, PlanTable


@dataclass(frozen=True)
class Stacks:
    """Each plan's stack as a code into `names` (the distinct stacks): what the interval rule reads for
    a whole plan table, one lookup per distinct stack instead of one string per plan."""

    codes: np.ndarray
    names: tuple[str, ...]

    def per_plan(self) -> np.ndarray:
        """The stack name of every plan (object array)."""
        return np.asarray(self.names, dtype=object)[self.codes]


STACKS = (
    "DeepSpeed 3D", "DeepSpeed ZeRO-3 before 0.6", "DeepSpeed ZeRO-3", "DeepSpeed ZeRO-0/1/2",
    "FSDP + TP/PP", "FSDP", "Megatron-FSDP", "Megatron",
)  # fmt: skip


def plan_stacks(plans: PlanTable, legacy_zero3: bool = False, moe: bool = False) -> Stacks:
    """Per plan, its stack (see `stack_names`), as codes."""
    engine = np.asarray(plans.engine)
    split = (plans.tp > 1) | (plans.pp > 1)
    z3 = plans.zero_stage == 3
    deepspeed = np.select([split, z3 & legacy_zero3, z3], [0, 1, 2], 3)
    fsdp = np.where(split, 4, 5)
    megatron = np.where(plans.zero_stage >= 2, 6, 7)
    ds, fs = ENGINE_CODES.index("deepspeed"), ENGINE_CODES.index("fsdp")
    name = np.select([engine == ds, engine == fs], [deepspeed, fsdp], megatron)
    kind = " MoE" if moe else ""
    names = tuple(f"{n}{kind}, {p}" for n in STACKS for p in PRECISION_CODES)
    return Stacks(name * len(PRECISION_CODES) + np.asarray(plans.precision), names)


def stack_names(plans: PlanTable, legacy_zero3: bool = False, moe: bool = False) -> np.ndarray:
    """Per plan, its stack as a readable name, e.g. "DeepSpeed ZeRO-3, bf16" (object array); a
    mixture-of-experts model's runs are a stack of their own ("Megatron MoE, fp8"): their expert layers,
    router and all-to-alls are code the dense runs never ran."""
    return plan_stacks(plans, legacy_zero3, moe).per_plan()


def on_gpu(stacks: np.ndarray, gpu_name: str) -> np.ndarray:
    """ "<stack> on <gpu>" keys, the pairs `Domain.stacks` records."""
    return np.asarray([f"{s} on {gpu_name}" for s in stacks], dtype=object)
