"""`Plan`: how one training step is laid out on the cluster, with the rules that need nothing but the
plan (what its engine can combine), checked when it is made.

Every part of the service (cost model, enumerator, search space, DeepSpeed config builder, worker)
takes this `Plan`. `plan_problem` (service/spec/plan_checks.py) is the only place that decides whether a
plan can run a model on a cluster.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.spec.engine import ENGINES, Engine, engine_rules, engines_with
from service.spec.errors import SpecError

Recompute = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp16", "fp32", "fp8"]
ZeroStage = Literal[0, 1, 2, 3]


class Plan(BaseModel):
    """A parallel layout: dp·tp·pp·cp GPUs, ZeRO stage and offload, batch split and recompute.

    Example:
        >>> Plan(dp=8, tp=4, pp=1, zero_stage=1, micro_batch=2, grad_accum=8).num_gpus
        32
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(1, gt=0, description="Data-parallel degree (replicas).")
    tp: int = Field(1, gt=0, description="Tensor-parallel degree (Megatron-style layers).")
    pp: int = Field(1, gt=0, description="Pipeline-parallel stages.")
    cp: int = Field(
        1,
        gt=0,
        description="Context-parallel degree: each sequence split over cp ranks (DeepSpeed-Ulysses for "
        "deepspeed, ring attention for megatron and fsdp; see service/catalog/engines/).",
    )
    ep: int = Field(
        1,
        gt=0,
        description="Expert-parallel degree (MoE models): each MoE block's routed experts split over ep "
        "ranks, which exchange the routed tokens by all-to-all; ep·expert_tp divides the dp·cp·tp ranks "
        "of a pipeline stage (the expert layout folded over them: service/catalog/engines/).",
    )
    expert_tp: int = Field(
        1,
        gt=0,
        description="Tensor-parallel degree inside each routed expert (Megatron-Core's "
        "--expert-tensor-parallel-size; 1 or tp where the engine allows only those).",
    )
    virtual_stages: int = Field(
        1,
        gt=0,
        description="Model chunks per pipeline stage (interleaved 1F1B: Megatron-LM, torchtitan's FSDP "
        "pipelines); DeepSpeed runs plain 1F1B (1). The bubble shrinks by this factor (with at least pp "
        "micro-batches), pipeline traffic grows by it.",
    )
    zero_stage: ZeroStage = Field(0, description="ZeRO stage: 1 shards optimizer, 2 +grads, 3 +params.")
    offload_optimizer: bool = Field(False, description="Optimizer states and step on CPU (ZeRO-Offload).")
    offload_params: bool = Field(
        False, description="Parameters on CPU between uses (ZeRO-Infinity, stage 3)."
    )
    zero_hpz_partition_size: int = Field(
        1,
        gt=0,
        description="ZeRO++ hpZ: ranks of the secondary (intra-node) parameter partition that backward "
        "gathers from; 1 = off (DeepSpeed ZeRO-3 only; Wang et al. 2023, arXiv 2306.10209, §3.2).",
    )
    shard_group_size: int = Field(
        0,
        ge=0,
        description="ZeRO-3 shard groups: shard the model states within groups of this many ZeRO ranks and "
        "replicate them across groups; 0 = shard over all dp·cp ranks. FSDP's hybrid shard (HSDP: "
        "ShardingStrategy.HYBRID_SHARD, FSDP2 on a (replicate, shard) mesh; Zhang et al. 2022's MiCS is "
        "the same layout). Engines with `shard_groups` in their rule table only.",
    )
    zero_quantized_weights: bool = Field(
        False, description="ZeRO++ qwZ: int8 weights in the ZeRO-3 all-gathers (DeepSpeed only)."
    )
    zero_quantized_gradients: bool = Field(
        False, description="ZeRO++ qgZ: int4 gradients in the ZeRO-3 reduce-scatter (DeepSpeed only)."
    )
    micro_batch: int = Field(1, gt=0, description="Sequences per micro-batch per data-parallel rank.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step (pipeline micro-batches).")
    recompute: Recompute = Field("none", description="Activation checkpointing: none, selective, full.")
    sequence_parallel: bool = Field(
        False, description="Shard norm/dropout activations over the TP group (Korthikanti et al.)."
    )
    comm_overlap: bool = Field(
        False,
        description="Megatron-Core's overlaps of pipeline and data-parallel traffic (megatron only): "
        "interleaved-pipeline sends behind the other chunks' compute (--overlap-p2p-communication), the "
        "gradient reduce behind backward and the parameter gather behind forward (--overlap-grad-reduce, "
        "--overlap-param-gather), as NVIDIA's recipes set them. Megatron-LM of 2021-22 had none.",
    )
    tp_comm_overlap: bool = Field(
        False,
        description="Megatron-Core's --tp-comm-overlap (megatron, with sequence_parallel): Transformer "
        "Engine userbuffers pipeline each TP all-gather / reduce-scatter with its GEMM, forward and "
        "backward.",
    )
    ep_comm_overlap: bool = Field(
        False,
        description="Megatron-Core's --overlap-moe-expert-parallel-comm (megatron): each micro-batch's "
        "MoE dispatch and combine all-to-alls run behind another micro-batch's compute (1F1B "
        "all-to-all overlap; with pp > 1 it needs the interleaved schedule).",
    )
    precision: Precision = Field(
        "bf16",
        description="Compute precision; bf16/fp16 mean mixed precision; fp8 = Transformer Engine's FP8 "
        "GEMMs in the transformer blocks, everything else bf16 (GPUs with FP8 tensor cores only).",
    )
    engine: Engine = Field(
        "deepspeed",
        description="What runs the plan: deepspeed (the service runs it), or, scored analytically, fsdp "
        "(PyTorch FSDP: zero_stage 2 = SHARD_GRAD_OP, 3 = FULL_SHARD) or megatron (Megatron-Core: TP×PP, "
        "interleaved schedule, zero_stage 1 = distributed optimizer, 2-3 = Megatron-FSDP without a "
        "pipeline).",
    )

    @model_validator(mode="after")
    def _check_self(self) -> Plan:
        problem = plan_only_problem(self)
        if problem:
            raise SpecError(*problem)  # a ValueError naming the field, for validate_as
        return self

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def short(self) -> str:
        """A compact label for tables and run names, e.g. `dp8-tp4-pp1-z1-mb2-ga8-rc:sel` (`-cp2`, `-ep8`
        and `-etp2` after the pipeline when above 1; ZeRO++ and shard-group settings after the offloads;
        `-ovl`, `-tpo` and `-epo` for Megatron-Core's overlaps, then `-fp8` last)."""
        off = ("-offopt" if self.offload_optimizer else "") + ("-offpar" if self.offload_params else "")
        off += f"-hpz{self.zero_hpz_partition_size}" if self.zero_hpz_partition_size > 1 else ""
        off += f"-sg{self.shard_group_size}" if self.shard_group_size else ""
        off += "-qw" if self.zero_quantized_weights else ""
        off += "-qg" if self.zero_quantized_gradients else ""
        sp = "-sp" if self.sequence_parallel and self.tp > 1 else ""
        sp += "-ovl" if self.comm_overlap else ""
        sp += "-tpo" if self.tp_comm_overlap else ""
        sp += "-epo" if self.ep_comm_overlap else ""
        sp += "-fp8" if self.precision == "fp8" else ""
        vs = f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        vs += f"-cp{self.cp}" if self.cp > 1 else ""
        vs += f"-ep{self.ep}" if self.ep > 1 else ""
        vs += f"-etp{self.expert_tp}" if self.expert_tp > 1 else ""
        engine = "" if self.engine == "deepspeed" else f"{self.engine}:"
        return (
            f"{engine}dp{self.dp}-tp{self.tp}-pp{self.pp}{vs}-z{self.zero_stage}{off}-mb{self.micro_batch}"
            f"-ga{self.grad_accum}-rc:{self.recompute[:4]}{sp}"
        )


def plan_only_problem(plan: Plan) -> tuple[str, str] | None:
    """Rules that need nothing but the plan: what the plan's engine can combine, read from its rule
    table (service/catalog/engines/). `service/plans/rules.py` restates them on columns, in this order."""
    if plan.offload_params and plan.zero_stage != 3:
        return "offload_params", "parameter offload needs zero_stage 3"
    if plan.offload_optimizer and plan.zero_stage == 0:
        return "offload_optimizer", "optimizer offload needs zero_stage 1, 2 or 3"
    hierarchical = _hierarchical_zero_problem(plan)
    if hierarchical:
        return hierarchical
    engine = _engine_problem(plan)
    if engine:
        return engine
    if plan.sequence_parallel and plan.tp == 1:
        return "sequence_parallel", "sequence parallelism needs tp > 1"
    if plan.tp_comm_overlap and not plan.sequence_parallel:
        # megatron/training/arguments.py: "Tensor parallel communication/GEMM overlap can happen only
        # when sequence parallelism is enabled".
        return "tp_comm_overlap", "tp_comm_overlap needs sequence_parallel (and so tp > 1)"
    if plan.virtual_stages > 1 and plan.pp == 1:
        return "virtual_stages", "virtual_stages > 1 needs pp > 1"
    if plan.virtual_stages > 1 and not engine_rules(plan.engine).interleaved_pipeline:
        return "virtual_stages", f"{plan.engine} has no interleaved pipeline schedule; allowed: 1"
    if plan.ep_comm_overlap and not engine_rules(plan.engine).expert_parallel.a2a_overlap:
        need = " or ".join(e for e in ENGINES if engine_rules(e).expert_parallel.a2a_overlap)
        return (
            "ep_comm_overlap",
            f"ep_comm_overlap (the 1F1B all-to-all overlap) needs engine {need}, not {plan.engine}",
        )
    if plan.ep_comm_overlap and plan.pp > 1 and plan.virtual_stages == 1:
        # megatron/core/transformer/transformer_config.py: overlap_moe_expert_parallel_comm with PP needs VPP.
        return (
            "ep_comm_overlap",
            "ep_comm_overlap with pp > 1 needs the interleaved schedule (virtual_stages > 1)",
        )
    allowed = {"one": (1,), "one_or_tp": (1, plan.tp)}.get(
        engine_rules(plan.engine).expert_parallel.expert_tp
    )
    if allowed is not None and plan.expert_tp not in allowed:
        split = (
            "over its TP ranks or not at all" if len(allowed) > 1 else "never (no expert tensor parallelism)"
        )
        choices = " or ".join(map(str, sorted(set(allowed))))
        message = f"{plan.expert_tp}: {plan.engine} splits experts {split}; allowed: {choices}"
        return "expert_tp", message
    return None


def uses_zero_plus_plus(plan: Plan) -> bool:
    """Whether the plan turns on ZeRO++ (hpZ, qwZ or qgZ)."""
    return plan.zero_hpz_partition_size > 1 or plan.zero_quantized_weights or plan.zero_quantized_gradients


def _hierarchical_zero_problem(plan: Plan) -> tuple[str, str] | None:
    # ZeRO++ lives in DeepSpeed's stage-3 engine (deepspeed/runtime/zero/stage3.py; DeepSpeed config docs:
    # "zero_hpz_partition_size", "zero_quantized_weights"); shard groups shard what ZeRO-3 shards (FSDP's
    # HYBRID_SHARD is FULL_SHARD within a group).
    rules = engine_rules(plan.engine)
    if uses_zero_plus_plus(plan):
        if not rules.zero_plus_plus:
            why = rules.reason("zero_plus_plus", "ZeRO++ is DeepSpeed's")
            return "engine", f"{why}; {plan.engine} has no ZeRO++"
        if plan.zero_stage != 3:
            return "zero_stage", "ZeRO++ (hpZ, qwZ, qgZ) partitions parameters: it needs zero_stage 3"
    if plan.shard_group_size:
        if not rules.shard_groups:
            owners = " or ".join(engines_with("shard_groups"))
            message = rules.reason("shard_groups", "no shard groups")
            return "shard_group_size", f"{message}; shard groups need engine {owners}"
        if plan.zero_stage != 3:
            return "zero_stage", "shard groups shard the parameters: they need zero_stage 3"
    return None


def _engine_problem(plan: Plan) -> tuple[str, str] | None:
    """The engine's own limits (its rule table): ZeRO stages, with pp and tp, offload, the overlaps.

    Tensor-parallel layers inside a pipeline run as Megatron-DeepSpeed runs them (Megatron TP layers in
    DeepSpeed's PipelineModule, PipeModelDataParallelTopology, ZeRO-1 across dp) and as torchtitan and
    Megatron-Core compose them; no rule is needed for tp × pp itself.
    """
    rules, name, z = engine_rules(plan.engine), plan.engine, plan.zero_stage
    if z not in rules.zero_stages:
        why = rules.reason("zero_stages", f"{name} has no ZeRO stage {z}")
        return "zero_stage", f"{why}; {name} has zero_stage {rules.stages_up_to(3)} only"
    if plan.pp > 1 and z > rules.max_zero_stage_with_pp:
        why = rules.reason("max_zero_stage_with_pp", "")
        allowed = rules.stages_up_to(rules.max_zero_stage_with_pp)
        return "zero_stage", f"{why}; with pp > 1 {name} supports zero_stage {allowed} only"
    if plan.tp > 1 and z > rules.max_zero_stage_with_tp:
        why = rules.reason("max_zero_stage_with_tp", "")
        allowed = rules.stages_up_to(rules.max_zero_stage_with_tp)
        return "zero_stage", f"{why}; with tp > 1 {name} supports zero_stage {allowed} only"
    offload = plan.offload_optimizer or plan.offload_params
    if offload and rules.offload == "none":
        return "offload_optimizer", f"{rules.reason('offload', '')}; {name} does not offload"
    if rules.offload == "together" and plan.offload_optimizer != plan.offload_params:
        why = rules.reason("offload", "")
        return "offload_params", f"{why}; {name} offloads optimizer and parameters together"
    cp_rule = rules.context_parallel
    if plan.cp > 1 and plan.pp > 1 and not cp_rule.with_pipeline:
        why = rules.reason("context_parallel", f"{name} runs cp without a pipeline")
        return "cp", f"{why}; with cp > 1 {name} needs pp = 1"
    if plan.cp > 1 and plan.sequence_parallel and not cp_rule.with_sequence_parallel:
        why = rules.reason("context_parallel", f"{name} runs cp without sequence parallelism")
        return "cp", f"{why}; with cp > 1 {name} needs sequence_parallel off"
    for flag, what in (("comm_overlap", "Megatron-Core's overlaps"), ("tp_comm_overlap", "TE userbuffers")):
        if getattr(plan, flag) and not getattr(rules, flag):
            need = " or ".join(engines_with(flag))
            return flag, f"{flag} ({what}) needs engine {need}, not {name}"
    return None
