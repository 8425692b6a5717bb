"""`plan_problem` (service/spec/plan_checks.py) restated on numpy columns, every engine's rules included.

`plan_problem` is scalar (one `Plan` at a time, ~10 µs each), too slow for 100,000 plans per second, so
`problem_codes` checks the same rules in the same order on a `PlanTable`. Both read each engine's limits
from its rule table (service/catalog/engines/, `service.spec.engine`): here as columns, one value per
row's engine. tests/plans/
test_enumerate.py checks, on every candidate of several clusters and on random tables over all engines,
that both give the same first reason.
"""

from __future__ import annotations

import numpy as np

from service.spec.engine import engine_rules
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.plan_table import ENGINE_CODES, PRECISION_CODES, PlanTable, engine_table
from service.spec.workload import Workload

# Why a candidate cannot run, in the order `plan_problem` checks its rules (code = index; 0 = valid).
# Each entry: (short reason for counts and tables, the `plan_problem` field, a fragment of its message).
INVALID_REASONS: tuple[tuple[str, str, str], ...] = (
    ("valid", "", ""),
    ("offload_params without zero_stage 3", "offload_params", "parameter offload needs zero_stage 3"),
    ("offload_optimizer with zero_stage 0", "offload_optimizer", "optimizer offload needs zero_stage"),
    ("ZeRO++ on an engine without it", "engine", "has no ZeRO++"),
    ("ZeRO++ without zero_stage 3", "zero_stage", "it needs zero_stage 3"),
    ("shard groups on an engine without them", "shard_group_size", "shard groups need engine"),
    ("shard groups without zero_stage 3", "zero_stage", "they need zero_stage 3"),
    ("ZeRO stage the engine lacks", "zero_stage", " has zero_stage "),
    ("ZeRO stage too high with pp > 1", "zero_stage", "with pp > 1 "),
    ("ZeRO stage too high with tp > 1", "zero_stage", "with tp > 1 "),
    ("offload on an engine without it", "offload_optimizer", " does not offload"),
    ("offload of optimizer or parameters alone", "offload_params", "offloads optimizer and parameters"),
    ("cp with pp on an engine without it", "cp", "needs pp = 1"),
    ("cp with sequence_parallel on an engine without it", "cp", "needs sequence_parallel off"),
    ("comm_overlap on an engine without it", "comm_overlap", "needs engine"),
    ("tp_comm_overlap on an engine without it", "tp_comm_overlap", "needs engine"),
    ("sequence_parallel without tp", "sequence_parallel", "sequence parallelism needs tp > 1"),
    ("tp_comm_overlap without sequence_parallel", "tp_comm_overlap", "needs sequence_parallel"),
    ("virtual_stages without pp", "virtual_stages", "virtual_stages > 1 needs pp > 1"),
    ("virtual_stages without an interleaved schedule", "virtual_stages", "no interleaved pipeline schedule"),
    ("ep_comm_overlap on an engine without it", "ep_comm_overlap", "needs engine"),
    ("ep_comm_overlap with pp but no interleaving", "ep_comm_overlap", "needs the interleaved schedule"),
    ("expert_tp the engine lacks", "expert_tp", " splits experts "),
    ("tp does not divide attention heads", "tp", "does not divide num_attention_heads"),
    ("tp does not divide KV heads", "tp", "does not divide num_key_value_heads"),
    ("Ulysses cp does not divide heads per TP rank", "cp", "attention heads per TP rank"),
    ("pp exceeds layers", "pp", "exceeds num_layers"),
    ("pp·virtual_stages exceeds layers", "virtual_stages", "exceeds num_layers"),
    ("ep on a dense model", "ep", "the model has no routed experts"),
    ("expert_tp on a dense model", "expert_tp", "the model has no routed experts"),
    ("ep does not divide the experts", "ep", "does not divide num_experts"),
    ("expert_tp does not divide the expert width", "expert_tp", "does not divide expert_ffn_hidden_size"),
    ("ZeRO stage too high with MoE blocks", "zero_stage", "with MoE blocks "),
    ("MoE blocks with pp on an engine without it", "pp", "runs MoE blocks without a pipeline"),
    ("router regime the engine lacks", "engine", "its MoE routers"),
    ("MoE with tp but no sequence_parallel", "sequence_parallel", "only with sequence_parallel on"),
    ("ep·expert_tp does not divide dp·cp·tp", "ep", "ranks of a pipeline stage"),
    ("hpZ group does not divide dp·cp", "zero_hpz_partition_size", "does not divide the"),
    ("shard group does not divide dp·cp", "shard_group_size", "does not divide the"),
    ("dp·tp·pp·cp is not the GPU count", "dp", "but the cluster has"),
    ("tp does not divide gpus_per_node", "tp", "must divide gpus_per_node"),
    ("fp8 on a GPU without FP8", "precision", "has no FP8 tensor cores"),
    ("hpZ group does not divide gpus_per_node", "zero_hpz_partition_size", "must divide gpus_per_node"),
    ("global batch does not split", "grad_accum", "but the global batch is"),
    ("seq_len does not split into cp chunks", "cp", "does not split into"),
    ("interleaved schedule's micro-batches do not group", "grad_accum", "interleaved schedule"),
)
VALID = 0
# Codes 1-22 are about combining choices (what an engine supports), never about the model, cluster or
# batch; dp = GPUs alone always passes them, so they never explain why a cluster has no valid plan.
COMBINATION_REASONS = frozenset(reason for reason, _, _ in INVALID_REASONS[1:23])


def reason_code(problem: tuple[str, str] | None) -> int:
    """The code of a `plan_problem` answer: matches its field and message against INVALID_REASONS."""
    if problem is None:
        return VALID
    field, message = problem
    for code, (_, reason_field, fragment) in enumerate(INVALID_REASONS):
        if code and field == reason_field and fragment in message:
            return code
    raise ValueError(f"plan_problem gave a reason the planner does not know: {problem}")


def _combination_rules(p: PlanTable) -> list[np.ndarray]:
    """The rules that need nothing but the plan (`plan_only_problem`), each engine's limits read from
    its rule table (service/catalog/engines/) as columns."""
    hpz, groups = p.zero_hpz_partition_size > 1, p.shard_group_size > 0
    zero_plus_plus = hpz | p.zero_quantized_weights | p.zero_quantized_gradients
    has_stage = np.array([[z in engine_rules(e).zero_stages for z in range(4)] for e in ENGINE_CODES])
    offload = engine_table("offload")
    cp_rules = [engine_rules(e).context_parallel for e in ENGINE_CODES]
    cp_with_pipeline = np.array([r.with_pipeline for r in cp_rules])
    cp_with_sp = np.array([r.with_sequence_parallel for r in cp_rules])
    return [
        p.offload_params & (p.zero_stage != 3),
        p.offload_optimizer & (p.zero_stage == 0),
        zero_plus_plus & ~p.engine_column("zero_plus_plus"),
        zero_plus_plus & (p.zero_stage != 3),
        groups & ~p.engine_column("shard_groups"),
        groups & (p.zero_stage != 3),
        ~has_stage[p.engine, p.zero_stage],
        (p.pp > 1) & (p.zero_stage > p.engine_column("max_zero_stage_with_pp")),
        (p.tp > 1) & (p.zero_stage > p.engine_column("max_zero_stage_with_tp")),
        (offload == "none")[p.engine] & (p.offload_optimizer | p.offload_params),
        (offload == "together")[p.engine] & (p.offload_optimizer != p.offload_params),
        (p.cp > 1) & (p.pp > 1) & ~cp_with_pipeline[p.engine],
        (p.cp > 1) & p.sequence_parallel & ~cp_with_sp[p.engine],
        p.comm_overlap & ~p.engine_column("comm_overlap"),
        p.tp_comm_overlap & ~p.engine_column("tp_comm_overlap"),
        p.sequence_parallel & (p.tp == 1),
        p.tp_comm_overlap & ~p.sequence_parallel,
        (p.virtual_stages > 1) & (p.pp == 1),
        (p.virtual_stages > 1) & ~p.engine_column("interleaved_pipeline"),
        p.ep_comm_overlap & ~_expert_rule("a2a_overlap")[p.engine],
        p.ep_comm_overlap & (p.pp > 1) & (p.virtual_stages == 1),
        _expert_tp_refused(p),
    ]


def _expert_tp_refused(p: PlanTable) -> np.ndarray:
    kind = _expert_rule("expert_tp")
    one = (kind == "one")[p.engine] & (p.expert_tp != 1)
    return one | ((kind == "one_or_tp")[p.engine] & (p.expert_tp != 1) & (p.expert_tp != p.tp))


def _expert_rule(field: str) -> np.ndarray:
    """`field` of every engine's expert-parallel rule, indexed by engine code."""
    return np.array([getattr(engine_rules(e).expert_parallel, field) for e in ENGINE_CODES])


def _moe_rules(p: PlanTable, model: ModelSpec) -> list[np.ndarray]:
    """`_moe_problem` (service/spec/plan_checks.py) on columns."""
    moe, none = model.moe, np.zeros(len(p), bool)
    if moe is None:
        return [p.ep > 1, p.expert_tp > 1, *[none] * 7]
    router = np.array([moe.router in engine_rules(e).expert_parallel.routers for e in ENGINE_CODES])
    return [
        none,
        none,
        moe.num_experts % p.ep != 0,
        moe.expert_ffn_hidden_size % p.expert_tp != 0,
        p.zero_stage > _expert_rule("max_zero_stage")[p.engine],
        (p.pp > 1) & ~_expert_rule("with_pipeline")[p.engine],
        ~router[p.engine],
        (p.tp > 1) & ~p.sequence_parallel & _expert_rule("tp_needs_sequence_parallel")[p.engine],
        (p.dp * p.cp * p.tp) % (p.ep * p.expert_tp) != 0,
    ]


def problem_codes(
    plans: PlanTable, model: ModelSpec, cluster: ClusterSpec | None = None, workload: Workload | None = None
) -> np.ndarray:
    """Per row, the code (index into INVALID_REASONS) of the first rule `plan_problem` would break.

    The same rules in the same order as service/spec/plan_checks.py; np.select takes the first true one.
    """
    p = plans
    cp_rules = [engine_rules(e).context_parallel for e in ENGINE_CODES]
    heads_rule = np.array([r.heads_divisible for r in cp_rules])[p.engine]
    rules = [
        *_combination_rules(p),
        model.num_attention_heads % p.tp != 0,
        model.kv_heads % p.tp != 0,
        heads_rule & ((model.num_attention_heads // p.tp) % p.cp != 0),
        p.pp > model.num_layers,
        p.pp * p.virtual_stages > model.num_layers,
        *_moe_rules(p, model),
        (p.dp * p.cp) % p.zero_hpz_partition_size != 0,
        (p.shard_group_size > 0) & ((p.dp * p.cp) % np.maximum(p.shard_group_size, 1) != 0),
    ]
    none = np.zeros(len(p), bool)
    if cluster is not None:
        gpus_per_node = cluster.gpus_per_node
        rules.append(p.dp * p.tp * p.pp * p.cp != cluster.num_gpus)
        rules.append((p.tp > gpus_per_node) | (gpus_per_node % p.tp != 0))
        rules.append(_fp8_refused(p.precision, cluster))
        rules.append(gpus_per_node % p.zero_hpz_partition_size != 0)
    else:
        rules += [none, none, none, none]
    if workload is not None:  # with the batch: a structure's grad_accum is a placeholder
        rules.append(_batch_refused(p.micro_batch, p.grad_accum, p.dp, workload))
        rules.append(_seq_split_refused(p, workload))
        rules.append(_interleave_refused(p.virtual_stages, p.pp, p.engine, p.grad_accum))
    else:
        rules += [none, none, none]
    return np.select(rules, list(range(1, len(rules) + 1)), default=VALID).astype(np.int8)


def _code(reason: str) -> int:
    return next(code for code, (short, _, _) in enumerate(INVALID_REASONS) if short == reason)


# The rules that read the expert-parallel columns (ep, expert_tp, ep_comm_overlap) of a MoE model's
# plans, in `problem_codes`' order; every other rule reads columns an expert-parallel variant shares with
# the row it was made from (enumerate._with_expert_variants), and none of these fails on that row (ep 1,
# expert_tp 1, no all-to-all overlap).
EXPERT_CODES = tuple(
    _code(reason)
    for reason in (
        "ep_comm_overlap on an engine without it",
        "ep_comm_overlap with pp but no interleaving",
        "expert_tp the engine lacks",
        "ep does not divide the experts",
        "expert_tp does not divide the expert width",
        "ep·expert_tp does not divide dp·cp·tp",
    )
)


def expert_variant_codes(variants: PlanTable, model: ModelSpec, base_codes: np.ndarray) -> np.ndarray:
    """`problem_codes` of a MoE model's expert-parallel variants of rows whose own codes are
    `base_codes` (one per variant row): the first of the base row's failing rule and the variant's own
    failing expert rules (`EXPERT_CODES`), which alone are checked on the variants. Millions of variants
    on a large MoE space are checked in a few column operations, not all rules each."""
    assert model.moe is not None
    v = variants
    rules = [
        v.ep_comm_overlap & ~_expert_rule("a2a_overlap")[v.engine],
        v.ep_comm_overlap & (v.pp > 1) & (v.virtual_stages == 1),
        _expert_tp_refused(v),
        model.moe.num_experts % v.ep != 0,
        model.moe.expert_ffn_hidden_size % v.expert_tp != 0,
        (v.dp * v.cp * v.tp) % (v.ep * v.expert_tp) != 0,
    ]
    none = len(INVALID_REASONS)  # after every code: "no rule fails" loses every minimum
    expert = np.select(rules, list(EXPERT_CODES), default=none)
    first = np.minimum(np.where(base_codes == VALID, none, base_codes), expert)
    return np.where(first == none, VALID, first).astype(np.int8)


# The rules that read the columns a structure is expanded into (precision, micro_batch, grad_accum) or
# the workload, in `problem_codes`' order; every other rule is decided by the structure alone.
EXPANSION_CODES = (
    _code("fp8 on a GPU without FP8"),
    _code("global batch does not split"),
    _code("seq_len does not split into cp chunks"),
    _code("interleaved schedule's micro-batches do not group"),
)


def precision_codes(precision: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """The first of `EXPANSION_CODES`, which reads the precision alone: FP8 where the GPU has none."""
    return np.where(_fp8_refused(precision, cluster), EXPANSION_CODES[0], VALID).astype(np.int8)


def micro_batch_codes(
    structures: PlanTable,
    row: np.ndarray,
    micro_batch: np.ndarray,
    grad_accum: np.ndarray,
    workload: Workload,
) -> np.ndarray:
    """The rest of `EXPANSION_CODES`, which read the structure and its micro-batch (and grad_accum)."""
    rules = [
        _batch_refused(micro_batch, grad_accum, structures.dp[row], workload),
        _seq_split_refused(structures, workload)[row],
        _interleave_refused(
            structures.virtual_stages[row], structures.pp[row], structures.engine[row], grad_accum
        ),
    ]
    return np.select(rules, list(EXPANSION_CODES[1:]), default=VALID).astype(np.int8)


def _fp8_refused(precision: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    return (precision == PRECISION_CODES.index("fp8")) & (not cluster.gpu.peak_tflops_fp8)


def _batch_refused(
    micro_batch: np.ndarray, grad_accum: np.ndarray, dp: np.ndarray, workload: Workload
) -> np.ndarray:
    return micro_batch * grad_accum * dp != workload.batch_sequences


INTERLEAVE_KINDS = ("none", "multiple_of_pp", "rounds_of_pp")


def _interleave_refused(
    v: np.ndarray, pp: np.ndarray, engine: np.ndarray, grad_accum: np.ndarray
) -> np.ndarray:
    """An interleaved plan whose micro-batches do not group as its engine's schedule takes them (read on
    the interleaved rows alone: millions of expanded rows on a large MoE space, most of them plain 1F1B)."""
    kinds = np.array([INTERLEAVE_KINDS.index(engine_rules(e).interleaved_microbatches) for e in ENGINE_CODES])
    v, pp, engine, ga = np.broadcast_arrays(v, pp, engine, grad_accum)
    refused = np.zeros(v.shape, dtype=bool)
    rows = np.flatnonzero(v > 1)
    kind, pp, ga = kinds[engine[rows]], pp[rows], ga[rows]
    multiple = (kind == 1) & (ga % pp != 0)
    rounds = (kind == 2) & (ga % np.maximum(1, ga // pp) != 0)
    refused[rows] = multiple | rounds
    return refused


def _seq_split_refused(p: PlanTable, workload: Workload) -> np.ndarray:
    """cp > 1 and the sequence does not split into the engine's chunks per rank times cp."""
    per_rank = np.array([engine_rules(e).context_parallel.seq_chunks_per_rank for e in ENGINE_CODES])
    return (p.cp > 1) & (workload.seq_len % (p.cp * per_rank[p.engine]) != 0)
