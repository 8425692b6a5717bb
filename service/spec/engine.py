"""`EngineRules`: what a training engine can combine and how it runs a step, read from data files.

Each engine (deepspeed, fsdp, megatron) is one YAML file under service/catalog/engines/. Every field
there holds a value, the source that documents it and, for a limit a plan can break, `why`: the start
of the one-line error. `plan_problem` (spec/plan_checks.py), the vectorised rules (plans/rules.py), the
enumerator and the cost model all read this one table; none of them branches on an engine's name.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.spec.errors import SpecError, validate_as

Engine = Literal["deepspeed", "fsdp", "megatron"]
ContextStyle = Literal["ulysses", "ring"]
ENGINES: tuple[str, ...] = get_args(Engine)
_DIR = Path(__file__).resolve().parent.parent / "catalog" / "engines"


class ContextParallelRule(BaseModel):
    """How an engine splits the sequence over `cp` ranks, and what that asks of the model and workload.

    ulysses: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509, §3): all-to-alls turn the
    sequence shard of q, k, v into a head shard before attention and back after, so each of the cp ranks
    needs whole query heads: (heads / tp) % cp == 0 (KV heads fewer than cp are repeated, DeepSpeed's
    uneven-head all-to-all). ring: Megatron-Core context parallelism and torchtitan's ring attention
    (Liu et al. 2023, arXiv 2310.01889) pass KV chunks around a ring; the load-balanced causal split
    cuts the sequence into 2·cp chunks.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    style: ContextStyle
    heads_divisible: bool  # (attention heads / tp) % cp must be 0
    seq_chunks_per_rank: int = Field(gt=0)  # seq_len % (cp · this) must be 0
    with_pipeline: bool  # cp > 1 together with pp > 1
    with_sequence_parallel: bool  # cp > 1 together with Megatron sequence parallelism


class ExpertParallelRule(BaseModel):
    """How an engine lays out a mixture-of-experts model's routed experts (`Plan.ep`, `Plan.expert_tp`).

    Expert parallelism splits each MoE block's experts over `ep` ranks, which exchange the routed tokens
    by all-to-all (Lepikhin et al. 2020, GShard, §2.2). All three engines give the expert layers a layout
    of their own over the dp·cp·tp ranks of a pipeline stage: expert_tp·ep·edp of them, expert_tp
    fastest (Megatron-Core's "MoE parallel folding", parallel_state.py; DeepSpeed's consecutive expert
    groups inside a stage, utils/groups.py; torchtitan's EP borrowing dp_shard·cp·tp, parallel_dims.py),
    so ep·expert_tp divides dp·cp·tp and the remaining edp ranks hold copies of the same expert slice.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    expert_tp: Literal["one", "one_or_tp", "any"]  # allowed expert tensor-parallel sizes
    # DeepSpeed drops the tokens its TP ranks duplicate before the all-to-all and all-gathers the expert
    # outputs over them after (sharded_moe.py drop_tokens / gather_tokens); the others exchange tokens
    # over the expert-TP group only.
    regathers_over_tp: bool
    # How the MoE layer is built, which sets what it saves for backward (costmodel/moe.py): DeepSpeed's
    # `deepspeed.moe` (top-k gating with one fp32 one-hot mask per chosen expert, a Python loop over the
    # local experts, each slicing its own copy of the all-to-all output) or a permute + grouped-GEMM
    # layer (Megatron-Core's GroupedMLP / TEGroupedMLP, torchtitan's GroupedExperts).
    layer: Literal["deepspeed_moe", "grouped"]
    max_zero_stage: int = Field(ge=0, le=3)  # highest ZeRO stage a MoE model runs with
    with_pipeline: bool  # MoE blocks inside a pipeline (pp > 1)
    routers: tuple[Literal["dropless", "capacity"], ...]  # router regimes the engine runs
    # With MoE blocks, tp > 1 only with sequence parallelism (Megatron-LM's arguments.py asserts it).
    tp_needs_sequence_parallel: bool = False
    a2a_overlap: bool  # dispatch and combine all-to-alls hidden behind other micro-batches' compute
    # Host seconds each local expert adds to a MoE block pass (forward and backward) beyond the block's
    # own (ModelParams moe_block_host_s; costmodel/compute.py `moe_host_floor_s`): a Python module call
    # per expert (DeepSpeed's loop) costs host time, a grouped GEMM that runs them all (torchtitan) or
    # launches them from C++ (Transformer Engine's GroupedLinear) next to none.
    host_s_per_local_expert: float = Field(0.0, ge=0)


class EngineRules(BaseModel):
    """One engine's limits (the plan rules) and its ways of running a step (the cost model's switches)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Engine
    # What the engine can combine.
    zero_stages: tuple[Literal[0, 1, 2, 3], ...]
    max_zero_stage_with_pp: int = Field(ge=0, le=3)  # highest ZeRO stage with pp > 1
    max_zero_stage_with_tp: int = Field(ge=0, le=3)  # highest ZeRO stage with tp > 1
    # separate: optimizer (stage ≥ 1) and parameters (stage 3) each on their own; together: both or
    # neither; none: no host offload.
    offload: Literal["separate", "together", "none"]
    zero_plus_plus: bool  # ZeRO++ (hpZ, qwZ, qgZ)
    # Shard groups (HSDP, MiCS): ZeRO-3 shards over groups of Plan.shard_group_size ranks, replicated
    # across groups; the replicas all-reduce their gradient shard once per step or per micro-batch.
    shard_groups: bool
    replica_sync: Literal["step", "micro_batch"] | None
    interleaved_pipeline: bool  # virtual_stages > 1 (interleaved 1F1B)
    comm_overlap: bool  # Plan.comm_overlap allowed
    tp_comm_overlap: bool  # Plan.tp_comm_overlap allowed
    context_parallel: ContextParallelRule
    expert_parallel: ExpertParallelRule
    # How it runs a step.
    vocab_parallel: bool  # embedding and loss split over the TP ranks
    transformer_engine: bool  # blocks built from Transformer Engine modules (saved tensors, fused attention)
    gradient_reduce: Literal["all_reduce", "reduce_scatter"]  # ZeRO 1-2's gradient collective
    fp32_main_grads: bool  # bf16/fp8 plans keep and reduce their gradients in fp32 (4 bytes, not 2)
    # How an interleaved schedule takes its micro-batches (grad_accum, m): "multiple_of_pp" (m % pp == 0),
    # "rounds_of_pp" (torch's: m % max(1, m // pp) == 0), or "none" (no interleaving).
    interleaved_microbatches: Literal["multiple_of_pp", "rounds_of_pp", "none"]
    gather_buffers: bool  # separate bucket buffers for the gradient reduce and parameter gather
    # A pipeline stage frees each micro-batch's output once sent (Megatron's deallocate_pipeline_outputs);
    # otherwise every micro-batch in flight holds its received input and its sent output.
    pipeline_output_deallocation: bool
    block_sharding_from_stage: int | None = Field(ge=0, le=3)  # per-block gather/reduce from this stage
    tp_backward_overlap: bool  # input-gradient TP collective behind the weight-gradient GEMM
    pipeline_scatter_gather: bool  # pipeline sends split over the TP ranks, all-gathered after
    # Each stage-boundary send and receive a blocking call of its own, so a middle stage's two exchanges
    # with a neighbour run one after the other (four transfers per micro-batch, not two).
    pipeline_blocking_p2p: bool
    # How FP8 casts find their scale: delayed (Transformer Engine's DelayedScaling, from an amax history;
    # the cast reads the tensor once) or dynamic (torchao's tensorwise scaling, an amax reduction over
    # the tensor before the cast reads it again).
    fp8_scaling: Literal["delayed", "dynamic"]
    # Plan columns whose feature has defects reported open in the engine's tracker, and what was
    # reported (issue numbers); the tie rule weighs them (service/plans/risk.py).
    open_defects: dict[str, str] = Field(default_factory=dict)
    # Per field: where it is documented, and the start of the error for a plan that breaks it.
    sources: dict[str, str]
    why: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _every_field_cited(self) -> EngineRules:
        cited = set(type(self).model_fields) - {"name", "sources", "why"}
        missing = sorted(cited - set(self.sources))
        if missing:
            raise ValueError(f"no source for {', '.join(missing)}")
        if self.shard_groups != (self.replica_sync is not None):
            raise ValueError("replica_sync (when shard groups' replicas reduce) goes with shard_groups only")
        highest = (self.max_zero_stage_with_pp, self.max_zero_stage_with_tp)
        if any(stage not in self.zero_stages for stage in highest):
            raise ValueError("max_zero_stage_with_pp / _with_tp must be one of zero_stages")
        return self

    def stages_up_to(self, highest: int) -> str:
        """The engine's ZeRO stages up to `highest`, as an error message lists them ("0, 1 or 2")."""
        stages = [str(s) for s in self.zero_stages if s <= highest]
        return stages[0] if len(stages) == 1 else f"{', '.join(stages[:-1])} or {stages[-1]}"

    def reason(self, field: str, default: str) -> str:
        return self.why.get(field, default)


def _flatten(data: Any, path: Path) -> Any:
    """{field: {value, source, why}} as the file writes it → EngineRules' fields, sources and why."""
    if not isinstance(data, dict):
        return data
    out: dict[str, Any] = {"sources": {}, "why": {}}
    for key, entry in data.items():
        if isinstance(entry, dict) and "value" in entry:
            out[key] = entry["value"]
            if "source" in entry:
                out["sources"][key] = entry["source"]
            if "why" in entry:
                out["why"][key] = entry["why"]
            extra = sorted(set(entry) - {"value", "source", "why"})
            if extra:
                raise SpecError(f"{key}.{extra[0]}", "unknown key; allowed: value, source, why", str(path))
        else:
            out[key] = entry
    return out


@cache
def engine_rules(name: str) -> EngineRules:
    """The rules of engine `name`, from service/catalog/engines/{name}.yaml."""
    from service.spec.experiment import read_yaml

    path = _DIR / f"{name}.yaml"
    return validate_as(EngineRules, _flatten(read_yaml(path), path), str(path))


def engines_with(field: str) -> list[str]:
    """The engines whose `field` is true (for messages: "needs engine megatron")."""
    return [e for e in ENGINES if getattr(engine_rules(e), field)]
