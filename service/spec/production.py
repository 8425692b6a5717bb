"""What the production run faces beyond the plan: interruptions, checkpoint storage, other GPU types.

Both are optional parts of an experiment; their defaults cite where each number comes from, so an
experiment without them still gets a goodput estimate with stated sources.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec

# Llama 3 (Dubey et al. 2024, arXiv:2407.21783, §3.3.4, Table 5): 419 unexpected interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_RATE_PER_GPU_HOUR = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
LLAMA3_SOURCE = (
    "Llama 3 paper (Dubey et al. 2024, arXiv:2407.21783, §3.3.4): 419 unexpected interruptions in "
    "54 days on 16,384 H100 GPUs"
)
# Kokolis et al. 2024 ("Revisiting Reliability in Large-Scale Machine Learning Research Clusters", Meta,
# arXiv:2410.21680, HPCA 2025; Fig. 7): over 11 months of Meta's shared A100 research clusters, jobs
# of 8 GPUs had a measured mean time to failure of 47.7 days and jobs of 1,024 GPUs 7.9 h. Per GPU that is
# 1 / (47.7 · 24 · 8) = 1.09e-4 and 1 / (7.9 · 1,024) = 1.24e-4 interruptions per GPU-hour: alike from 8
# to 1,024 GPUs, and 5.5–6.3× Llama 3's dedicated, burned-in 16,384-GPU run (1.97e-5). (Their hardware-only
# node rate, 6.50 failures per 1,000 node-days on RSC-1 and 2.34 on RSC-2, counted on jobs over 128 GPUs,
# is lower; the job-level MTTF is what stops a run.)
SMALL_JOB_MTTF_DAYS = 47.7
SMALL_JOB_GPUS = 8
SMALL_CLUSTER_RATE_PER_GPU_HOUR = 1.0 / (SMALL_JOB_MTTF_DAYS * 24 * SMALL_JOB_GPUS)
SMALL_CLUSTER_SOURCE = (
    "Kokolis et al. 2024 (Meta research clusters, arXiv:2410.21680, Fig. 7): 8-GPU jobs' measured mean "
    "time to failure 47.7 days, i.e. 1 / (47.7 days × 8 GPUs); their 1,024-GPU jobs' 7.9 h gives a "
    "similar 1.2e-4 per GPU-hour"
)
# The largest job size Kokolis et al. measured (beyond it their MTTFs are projections). Up to it the
# default is their shared-cluster rate; above it, a run is planned on a dedicated fleet like Llama 3's.
SMALL_CLUSTER_MAX_GPUS = 1024
# Same paper, §3.3.1: Tectonic sustains 2 TB/s (peaks 7 TB/s) for 16,384 GPUs' checkpoints.
STORAGE_GB_PER_S_PER_GPU = 2000.0 / LLAMA3_GPUS
STORAGE_SOURCE = (
    "Llama 3 paper §3.3.1: Tectonic storage sustains 2 TB/s for 16,384 GPUs, i.e. 0.122 GB/s per GPU "
    "writing in parallel"
)


class GoodputSpec(BaseModel):
    """Interruptions and checkpointing of the production run (what turns step time into wall-clock).

    The interruption rate's default depends on the cluster (`rate_per_gpu_hour`): up to 1,024 GPUs the
    per-GPU rate Kokolis et al. 2024 measured on small jobs in Meta's shared research clusters (1.09e-4,
    the rented or shared cluster's case), above it Llama 3's dedicated 16,384-GPU fleet (1.97e-5).

    Example (YAML, under an experiment):
        goodput: {interruptions_per_gpu_hour: 2.0e-5, storage_bandwidth_gb_per_s: 4.0, restart_minutes: 10}
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    interruptions_per_gpu_hour: float | None = Field(
        None,
        ge=0,
        description="Unexpected job interruptions per GPU-hour (default by cluster size: Kokolis et al. "
        "2024's small-job rate up to 1,024 GPUs, Llama 3's fleet rate above; see rate_per_gpu_hour).",
    )
    interruption_source: str | None = Field(
        None,
        description="Where your interruptions_per_gpu_hour comes from (only with that rate; the default "
        "rates carry their own source).",
    )
    storage_bandwidth_gb_per_s: float | None = Field(
        None,
        gt=0,
        description="Aggregate checkpoint write bandwidth (GB/s); default 0.122 GB/s per GPU (Llama 3).",
    )
    storage_source: str = Field(STORAGE_SOURCE, description="Where the bandwidth comes from.")
    restart_minutes: float = Field(
        10.0,
        ge=0,
        description="Time from an interruption to training again, before reading the checkpoint "
        "(rescheduling, process start-up, NCCL init); an assumption, set yours.",
    )

    def bandwidth_gb_per_s(self, num_gpus: int) -> float:
        if self.storage_bandwidth_gb_per_s is not None:
            return self.storage_bandwidth_gb_per_s
        return STORAGE_GB_PER_S_PER_GPU * num_gpus

    def rate_per_gpu_hour(self, num_gpus: int) -> float:
        """λ: the experiment's rate, else the default for a cluster of `num_gpus` GPUs."""
        if self.interruptions_per_gpu_hour is not None:
            return self.interruptions_per_gpu_hour
        if num_gpus <= SMALL_CLUSTER_MAX_GPUS:
            return SMALL_CLUSTER_RATE_PER_GPU_HOUR
        return LLAMA3_RATE_PER_GPU_HOUR

    def source_for(self, num_gpus: int) -> str:
        """Where `rate_per_gpu_hour(num_gpus)` comes from, and why that default for this size."""
        if self.interruptions_per_gpu_hour is not None:
            return self.interruption_source or "the experiment's goodput.interruptions_per_gpu_hour"
        if num_gpus <= SMALL_CLUSTER_MAX_GPUS:
            return (
                f"{SMALL_CLUSTER_SOURCE}; the default for a cluster of at most {SMALL_CLUSTER_MAX_GPUS:,} "
                f"GPUs (this one: {num_gpus:,}), set goodput.interruptions_per_gpu_hour to yours"
            )
        return (
            f"{LLAMA3_SOURCE}; the default above {SMALL_CLUSTER_MAX_GPUS:,} GPUs (this cluster: "
            f"{num_gpus:,}), a dedicated fleet's rate, set goodput.interruptions_per_gpu_hour to yours"
        )

    def young_daly_hours(self, num_gpus: int, ckpt_bytes: float) -> float:
        """Young's checkpoint interval τ = sqrt(2 · C · M) (Young 1974; Daly 2006, first order), C the
        write time and M = 1 / (λ · N) the job's mean time between failures; inf when λ = 0."""
        rate = self.rate_per_gpu_hour(num_gpus) * num_gpus
        if rate <= 0:
            return float("inf")
        write_hours = ckpt_bytes / (self.bandwidth_gb_per_s(num_gpus) * 1e9) / 3600.0
        return float((2.0 * write_hours / rate) ** 0.5)


def checkpoint_bytes(model: ModelSpec, precision: str) -> float:
    """Weights + fp32 master + Adam moments: 14 B/param in mixed precision, 12 B/param in fp32 (the K = 12
    optimizer bytes of ZeRO, Rajbhandari et al. 2020, §3.1, plus the 16-bit weights)."""
    per_param = 12.0 if precision == "fp32" else 14.0
    return per_param * model.num_params


class OptimizerSpec(BaseModel):
    """The production run's AdamW and learning-rate schedule, written into the DeepSpeed config `run`
    ships (`optimizer` and a `WarmupCosineLR` `scheduler`, deepspeed/runtime/lr_schedules.py). Memory and
    speed do not depend on them; the proxies keep a constant rate so their losses compare.

    Example (YAML): `optimizer: {lr: 2.0e-5, warmup_fraction: 0.03}`, Llama 2's fine-tuning rate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(
        3e-4, gt=0, le=1, description="Peak learning rate (default: a pre-training rate; fine-tunes use less)"
    )
    warmup_fraction: float = Field(
        0.01, ge=0, le=0.5, description="Share of the steps spent warming up linearly from 0."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Floor of the cosine decay, as a share of lr.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW's decoupled weight decay.")

    def scheduler(self, total_steps: int) -> dict[str, Any]:
        """DeepSpeed's `scheduler` section for a run of `total_steps` optimizer steps."""
        warmup = max(1, round(self.warmup_fraction * total_steps))  # DeepSpeed needs a positive int
        return {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(total_steps, warmup + 1),
                "warmup_num_steps": warmup,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": self.min_lr_ratio,
                "warmup_type": "linear",
            },
        }


class GPUAlternative(BaseModel):
    """Another cluster the same run could use, compared under the same budget.

    Example (YAML): `alternatives: [{cluster: {gpu: a100-sxm-80gb, num_nodes: 8}, availability: "2 weeks"}]`
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: ClusterSpec = Field(description="GPU type, nodes, GPUs per node and price per GPU-hour.")
    availability: str = Field("", description="When or how it can be had (reported, not scored).")
