"""DeepSpeed ZeRO buffer settings, derived from the model. Shared by the cost model (which predicts the
memory these buffers take) and the DeepSpeed config builder (which writes them), so both agree.

The values follow Hugging Face's `"auto"` convention for DeepSpeed configs
(transformers/integrations/deepspeed.py: reduce_bucket_size = h², stage3_prefetch_bucket_size = 0.9·h²,
stage3_param_persistence_threshold = 10·h), which scales buckets with the model instead of DeepSpeed's
fixed 5e8-element defaults (a 1-2 GB buffer that would dwarf a small proxy).
"""

from __future__ import annotations

from dataclasses import dataclass

from service.spec.model import ModelSpec


@dataclass(frozen=True)
class ZeroKnobs:
    """Element counts (not bytes) of DeepSpeed's ZeRO communication buffers."""

    reduce_bucket_elements: int
    allgather_bucket_elements: int
    stage3_prefetch_bucket_elements: int
    stage3_param_persistence_threshold: int  # params with fewer elements stay whole on every rank
    stage3_max_live_parameters: int = 1_000_000_000

    @classmethod
    def for_model(cls, model: ModelSpec) -> ZeroKnobs:
        h = model.hidden_size
        return cls(
            reduce_bucket_elements=h * h,
            allgather_bucket_elements=h * h,
            stage3_prefetch_bucket_elements=int(0.9 * h * h),
            stage3_param_persistence_threshold=10 * h,
        )
