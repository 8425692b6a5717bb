"""DeepSpeed ZeRO buffer settings, derived from the model, and the ZeRO++ config keys of a plan.
Shared by the cost model (which predicts the memory these buffers take) and the DeepSpeed config
builder (which writes them), so both agree.

The values follow Hugging Face's `"auto"` convention for DeepSpeed configs
(transformers/integrations/deepspeed.py: reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h²,
stage3_param_persistence_threshold = 10·h), which scales buckets with the model instead of DeepSpeed's
fixed 5e8-element defaults (a 1-2 GB buffer that would dwarf a small proxy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.spec.model import ModelSpec

if TYPE_CHECKING:
    from service.spec.plan import Plan


@dataclass(frozen=True)
class ZeroKnobs:
    """Element counts (not bytes) of DeepSpeed's ZeRO communication buffers."""

    reduce_bucket_elements: int
    allgather_bucket_elements: int
    stage3_prefetch_bucket_elements: int
    stage3_param_persistence_threshold: int  # params with fewer elements stay whole on every rank
    stage3_max_live_parameters: int = 1_000_000_000
    # A parameter released after a module is kept gathered when its next use comes within this many
    # elements of other modules' parameters (DeepSpeed's default, `stage3_max_reuse_distance`).
    stage3_max_reuse_distance: int = 1_000_000_000

    @classmethod
    def for_model(cls, model: ModelSpec) -> ZeroKnobs:
        h = model.hidden_size
        return cls(
            reduce_bucket_elements=h * h,
            allgather_bucket_elements=h * h,
            stage3_prefetch_bucket_elements=int(0.9 * h * h),
            stage3_param_persistence_threshold=10 * h,
        )


def hierarchical_zero_config(plan: Plan) -> dict[str, Any]:
    """The `zero_optimization` keys that turn on the plan's ZeRO++ settings ({} when none).

    DeepSpeed config docs ("ZeRO++"; deepspeed/runtime/zero/config.py): `zero_hpz_partition_size`
    (hpZ secondary partition, ideally the GPUs of a node), `zero_quantized_weights` (qwZ),
    `zero_quantized_gradients` (qgZ). Merge the result into the stage-3 section. Shard groups have no
    key: DeepSpeed 0.19.8 removed MiCS (its runtime/config.py refuses `mics_shard_size`), so the
    engine rules refuse `shard_group_size` on deepspeed plans before a config is written.

    Example:
        >>> from service.spec.plan import Plan
        >>> hierarchical_zero_config(Plan(dp=16, zero_stage=3, zero_hpz_partition_size=8,
        ...     zero_quantized_weights=True, zero_quantized_gradients=True))
        {'zero_hpz_partition_size': 8, 'zero_quantized_weights': True, 'zero_quantized_gradients': True}
    """
    keys: dict[str, Any] = {}
    if plan.zero_hpz_partition_size > 1:
        keys["zero_hpz_partition_size"] = plan.zero_hpz_partition_size
    if plan.zero_quantized_weights:
        keys["zero_quantized_weights"] = True
    if plan.zero_quantized_gradients:
        keys["zero_quantized_gradients"] = True
    return keys
