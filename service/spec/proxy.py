"""`ProxySpec`: how the production model and cluster are scaled down for a real measured run."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.spec.errors import SpecError

# A proxy is a small run: more workers than this is a production run, or a typo (`num_workers: 1e9`).
MAX_PROXY_WORKERS = 1024


class ProxySpec(BaseModel):
    """A proxy keeps the production model's architecture and the plan's shape, at a smaller scale."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(2, gt=0, description="Transformer blocks in the proxy model.")
    hidden_scale: int = Field(1, gt=0, description="Divide hidden and MLP widths by this (heads are kept).")
    vocab_size: int | None = Field(None, gt=0, description="Proxy vocabulary; defaults to the model's.")
    seq_len: int | None = Field(None, gt=0, description="Proxy sequence length; defaults to the workload's.")
    num_workers: int = Field(
        2, gt=0, le=MAX_PROXY_WORKERS, description="Ray Train workers (GPUs, or CPU processes) per trial."
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the workers run.")
    precision: Literal["bf16", "fp16", "fp32"] = Field(
        "fp32", description="Proxy compute precision (CPU proxies run fp32)."
    )
    steps: int = Field(6, gt=0, description="Optimizer steps per trial (more than warmup_steps).")
    warmup_steps: int = Field(2, ge=0, description="Steps left out of the timing.")
    checkpoint_every: int = Field(0, ge=0, description="Save a checkpoint every K steps (0 = never).")
    data: Literal["synthetic"] | str = Field(
        "synthetic",
        description="`synthetic` (seeded random tokens) or a path to a binary file of uint16/uint32 "
        "token ids.",
    )
    seed: int = Field(1234, description="Seed for weights, data and dropout.")
    memory_limit_gib: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Cap on each worker's memory; a plan that exceeds it is reported as oom.",
    )
    collective_timeout_s: float = Field(
        120.0, gt=0, allow_inf_nan=False, description="A collective that takes longer ends the trial."
    )

    @model_validator(mode="after")
    def _timed_steps(self) -> ProxySpec:
        # The worker times the steps after warmup_steps; with none left it would time every step,
        # warmup included, and report that as the plan's speed.
        if self.steps <= self.warmup_steps:
            raise SpecError(
                "steps",
                f"{self.steps} leaves no timed step after warmup_steps {self.warmup_steps}; "
                f"allowed: more than {self.warmup_steps}",
            )
        return self
