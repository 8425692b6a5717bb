"""What makes one plan riskier to run than another that the cost model cannot tell apart from it.

Inside a tie group (plans whose objective differs by less than the model's resolution,
`plans/select.py`) the choice goes to the plan with the least that can go wrong on the day, in this
order, each a named reason the memo prints:

1. **Offload to host**: every offloaded state crosses PCIe every step and runs the optimizer on the
   CPU; host memory, pinned-buffer limits and the CPU itself become part of the plan (ZeRO-Offload,
   Ren et al. 2021, §4: the CPU step and the PCIe copies are what it adds).
2. **Open defects**: features with bugs reported open in the engine's tracker (`EngineRules.open_defects`
   in service/catalog/engines/, each with its issues): a run that does not converge or hangs costs the
   whole budget, whatever it was predicted to save.
3. **Memory margin**: a plan whose memory, at the analytical prior's error (`MEMORY_RISK_ERROR` on
   activations and model state, the rule the memo uses when no proxy measured it), would pass the
   limit fails on its first steps if the model is off by that much.
4. **Moving parts**: each parallelism or communication feature beyond plain data parallelism is one
   more thing to configure, one more process group and one more code path in the engine: tensor,
   pipeline and context parallelism, sequence parallelism, interleaved stages, ZeRO++'s hpZ and
   quantized collectives, hybrid shard groups.

Only then does the objective decide. The reasons are counted per plan so the memo can say which one
separated the choice from each tied plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.costmodel.result import EstimateTable
from service.spec.engine import engine_rules
from service.spec.plan_table import ENGINE_CODES, PlanTable

# The analytical prior's relative error on activations and model state (design/calibration.py states the
# same rule for memory intervals when no proxy ran).
MEMORY_RISK_ERROR = 0.25


# (plan column, name): the features counted as moving parts; a column is "used" when it is above its
# off value (1 for degrees, 0 / False for flags and shard groups).
FEATURES: tuple[tuple[str, str], ...] = (
    ("tp", "tensor parallelism"),
    ("pp", "pipeline parallelism"),
    ("cp", "context parallelism"),
    ("sequence_parallel", "sequence parallelism"),
    ("virtual_stages", "interleaved stages"),
    ("zero_hpz_partition_size", "ZeRO++ hpZ"),
    ("zero_quantized_weights", "quantized weights"),
    ("zero_quantized_gradients", "quantized gradients"),
    ("shard_group_size", "hybrid shard groups"),
)
_OFF_AT_ONE = {"tp", "pp", "cp", "virtual_stages", "zero_hpz_partition_size"}


def used(plans: PlanTable, column: str) -> np.ndarray:
    values = np.asarray(getattr(plans, column))
    return values > (1 if column in _OFF_AT_ONE else 0)


def moving_parts(plans: PlanTable) -> dict[str, np.ndarray]:
    """Per feature name, whether each plan uses it (bool columns)."""
    return {name: used(plans, column) for column, name in FEATURES}


def open_defects(plans: PlanTable) -> dict[str, np.ndarray]:
    """Per reported defect (its text), whether each plan uses the feature on an engine it is reported
    for (bool columns)."""
    out: dict[str, np.ndarray] = {}
    for code, engine in enumerate(ENGINE_CODES):
        mine = plans.engine == code
        for column, text in engine_rules(engine).open_defects.items():
            out[text] = out.get(text, np.zeros(len(plans), bool)) | (mine & used(plans, column))
    return out


def offloads(plans: PlanTable) -> np.ndarray:
    """How many model states each plan offloads to host memory (optimizer, parameters)."""
    return plans.offload_optimizer.astype(np.int64) + plans.offload_params.astype(np.int64)


def memory_high_bytes(est: EstimateTable) -> np.ndarray:
    """Memory per GPU if the model is off by its prior error on activations and model state."""
    variable = est.activations_bytes + est.logits_bytes + est.params_bytes + est.grads_bytes
    return np.asarray(est.total_bytes + MEMORY_RISK_ERROR * (variable + est.optimizer_bytes), dtype=float)


@dataclass(frozen=True)
class Risk:
    """Risk keys per plan, lower is safer, compared in this order."""

    offloads: np.ndarray
    tight_memory: np.ndarray  # memory at the prior's error would pass the limit
    features: dict[str, np.ndarray]
    defects: dict[str, np.ndarray]  # per reported defect, the plans that use its feature

    @property
    def defect_count(self) -> np.ndarray:
        if not self.defects:
            return np.zeros(len(self.offloads), dtype=np.int64)
        return np.sum(list(self.defects.values()), axis=0).astype(np.int64)

    @property
    def parts(self) -> np.ndarray:
        return np.sum(list(self.features.values()), axis=0).astype(np.int64)

    def order(self, rows: np.ndarray) -> np.ndarray:
        """`rows` (already best objective first) reordered safest first; np.lexsort is stable, so the
        objective order decides among equally risky plans."""
        keys = (self.parts[rows], self.tight_memory[rows], self.defect_count[rows], self.offloads[rows])
        return rows[np.lexsort(keys)]

    def riskier_than(self, row: int) -> np.ndarray:
        """Per plan, whether it loses to `row` on a named risk (what `why_riskier` would name)."""
        off, tight, parts, bugs = self.offloads, self.tight_memory, self.parts, self.defect_count
        return (off > off[row]) | (bugs > bugs[row]) | (tight & ~tight[row]) | (parts > parts[row])

    def why_riskier(self, row: int, than: int) -> list[str]:
        """What `row` has that `than` does not, as named reasons (empty when it is no riskier)."""
        out: list[str] = []
        if self.offloads[row] > self.offloads[than]:
            out.append("offloads to host memory")
        if self.defect_count[row] > self.defect_count[than]:
            bugs = [text for text, hit in self.defects.items() if hit[row] and not hit[than]]
            out.append("uses a feature with defects reported open (" + "; ".join(bugs) + ")")
        if self.tight_memory[row] and not self.tight_memory[than]:
            out.append(f"would pass the memory limit at the prior's {MEMORY_RISK_ERROR:.0%} memory error")
        if self.parts[row] > self.parts[than]:
            extra = [n for n, used in self.features.items() if used[row] and not used[than]]
            extra = extra or [n for n, used in self.features.items() if used[row]]
            out.append("has more moving parts (" + ", ".join(extra) + ")")
        return out


def risk_of(plans: PlanTable, est: EstimateTable) -> Risk:
    return Risk(
        offloads=offloads(plans),
        tight_memory=memory_high_bytes(est) > est.memory_limit_bytes,
        features=moving_parts(plans),
        defects=open_defects(plans),
    )
