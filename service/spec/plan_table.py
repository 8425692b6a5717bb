"""`PlanTable`: many `Plan`s as numpy columns, so the cost model scores them in one vectorised pass.

The cost model's formulas take numpy arrays (or scalars) and never loop over plans; the scalar
`estimate()` is the same code on a one-row table.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import get_args

import numpy as np

from service.spec.engine import engine_rules
from service.spec.plan import Engine, Plan, Precision, Recompute

RECOMPUTE_CODES: tuple[str, ...] = get_args(Recompute)  # ("none", "selective", "full")
PRECISION_CODES: tuple[str, ...] = get_args(Precision)  # ("bf16", "fp16", "fp32")
ENGINE_CODES: tuple[str, ...] = get_args(Engine)  # ("deepspeed", "fsdp", "megatron")


@dataclass(frozen=True)
class PlanTable:
    """Columns of `Plan` fields; `recompute` and `precision` hold indexes into the *_CODES tuples."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    zero_stage: np.ndarray
    offload_optimizer: np.ndarray
    offload_params: np.ndarray
    micro_batch: np.ndarray
    grad_accum: np.ndarray
    recompute: np.ndarray
    sequence_parallel: np.ndarray
    precision: np.ndarray
    virtual_stages: np.ndarray  # interleaved 1F1B chunks per stage (1 = plain 1F1B)
    engine: np.ndarray  # index into ENGINE_CODES
    cp: np.ndarray  # context-parallel degree (1 = whole sequences per rank)
    zero_hpz_partition_size: np.ndarray  # ZeRO++ hpZ secondary partition (1 = off)
    shard_group_size: np.ndarray  # ZeRO-3 shard group, HSDP (0 = all dp·cp ranks)
    zero_quantized_weights: np.ndarray  # ZeRO++ qwZ
    zero_quantized_gradients: np.ndarray  # ZeRO++ qgZ
    comm_overlap: np.ndarray  # Megatron-Core's pipeline and data-parallel overlaps (megatron only)
    tp_comm_overlap: np.ndarray  # Megatron-Core's TE-userbuffer TP overlap (megatron, with SP)
    ep: np.ndarray  # expert-parallel degree (1 = every rank holds all routed experts)
    expert_tp: np.ndarray  # tensor-parallel degree inside each routed expert
    ep_comm_overlap: np.ndarray  # Megatron-Core's 1F1B MoE all-to-all overlap

    def __len__(self) -> int:
        return len(self.dp)

    def engine_column(self, field: str) -> np.ndarray:
        """Per row, `field` of the row's engine rule table (service/catalog/engines/)."""
        return engine_table(field)[self.engine]

    def expert_rule_column(self, field: str) -> np.ndarray:
        """Per row, `field` of the row's engine's expert-parallel rule (`ExpertParallelRule`)."""
        return expert_rule_table(field)[self.engine]

    def engine_is(self, field: str, value: str) -> np.ndarray:
        """Per row, whether its engine's `field` is `value` (compared on the engine table, not per row)."""
        return (engine_table(field) == value)[self.engine]

    @classmethod
    def from_columns(cls, **cols: np.ndarray) -> PlanTable:
        """Builds a table from equal-length columns (ints; bools for the flags); `virtual_stages` and
        `cp` default to 1 (plain 1F1B, no context parallelism), `engine` to deepspeed, the ZeRO++ and
        shard-group columns and the Megatron overlaps to off, `ep` and `expert_tp` to 1."""
        ints = {"dp", "tp", "pp", "zero_stage", "micro_batch", "grad_accum", "recompute", "precision"}
        ints |= {
            "virtual_stages",
            "engine",
            "cp",
            "zero_hpz_partition_size",
            "shard_group_size",
            "ep",
            "expert_tp",
        }
        n = len(np.asarray(cols["dp"]))
        cols.setdefault("virtual_stages", np.ones(n, dtype=np.int64))
        cols.setdefault("engine", np.zeros(n, dtype=np.int64))  # deepspeed
        cols.setdefault("cp", np.ones(n, dtype=np.int64))
        cols.setdefault("zero_hpz_partition_size", np.ones(n, dtype=np.int64))
        cols.setdefault("shard_group_size", np.zeros(n, dtype=np.int64))
        cols.setdefault("zero_quantized_weights", np.zeros(n, dtype=bool))
        cols.setdefault("zero_quantized_gradients", np.zeros(n, dtype=bool))
        cols.setdefault("comm_overlap", np.zeros(n, dtype=bool))
        cols.setdefault("tp_comm_overlap", np.zeros(n, dtype=bool))
        cols.setdefault("ep", np.ones(n, dtype=np.int64))
        cols.setdefault("expert_tp", np.ones(n, dtype=np.int64))
        cols.setdefault("ep_comm_overlap", np.zeros(n, dtype=bool))
        return cls(**{k: np.asarray(v, dtype=np.int64 if k in ints else bool) for k, v in cols.items()})

    @classmethod
    def from_plans(cls, plans: list[Plan]) -> PlanTable:
        cols: dict[str, list[object]] = {f.name: [] for f in fields(cls)}
        for p in plans:
            for name in cols:
                value = getattr(p, name)
                if name == "recompute":
                    value = RECOMPUTE_CODES.index(value)
                elif name == "precision":
                    value = PRECISION_CODES.index(value)
                elif name == "engine":
                    value = ENGINE_CODES.index(value)
                cols[name].append(value)
        return cls.from_columns(**{k: np.asarray(v) for k, v in cols.items()})

    def take(self, index: np.ndarray) -> PlanTable:
        """Rows at `index` (an integer array or a boolean mask)."""
        index = np.asarray(index)
        if index.dtype == bool:  # a mask's rows once, not once per column
            index = np.flatnonzero(index)
        return PlanTable(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def row(self, i: int) -> Plan:
        values = {f.name: getattr(self, f.name)[i].item() for f in fields(self)}
        values["recompute"] = RECOMPUTE_CODES[values["recompute"]]
        values["precision"] = PRECISION_CODES[values["precision"]]
        values["engine"] = ENGINE_CODES[values["engine"]]
        return Plan(**values)


def concat(tables: list[PlanTable]) -> PlanTable:
    """The rows of `tables`, one after the other."""
    names = [f.name for f in fields(PlanTable)]
    return PlanTable(**{name: np.concatenate([getattr(t, name) for t in tables]) for name in names})


def engine_table(field: str) -> np.ndarray:
    """`field` of every engine's rule table, indexed by engine code (ENGINE_CODES' order)."""
    return np.array([getattr(engine_rules(e), field) for e in ENGINE_CODES])


def expert_rule_table(field: str) -> np.ndarray:
    """`field` of every engine's expert-parallel rule (`ExpertParallelRule`), indexed by engine code."""
    return np.array([getattr(engine_rules(e).expert_parallel, field) for e in ENGINE_CODES])
