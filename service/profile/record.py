"""The profile file: what was measured, on what, and the `GPUSpec` fields derived from it.

A profile is YAML (`load_profile` / `Profile.save`): the device, the measurements (typed records, one
per timed kernel), and `overrides`, the catalog fields the measurements give (`Profile.gpu_overrides`),
to be laid over the catalog entry named in `base_gpu` (`Profile.gpu_spec`).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from service.spec.errors import validate_as
from service.spec.hardware import GPUSpec

_STRICT = ConfigDict(extra="forbid", frozen=True)


class DeviceInfo(BaseModel):
    model_config = _STRICT

    kind: str = Field(description="cuda or cpu.")
    name: str = Field(description="CUDA device name, or the CPU model.")
    threads: int = Field(description="torch intra-op threads (CPU) or SM count (CUDA).")
    torch_version: str
    platform: str
    date: str = Field(description="UTC time the profile was taken (ISO 8601).")


class GemmResult(BaseModel):
    """One (m×k)·(k×n) matmul, `m` = tokens."""

    model_config = _STRICT

    label: str = Field(
        description="Which matmul of the model (qkv, out, mlp_in, mlp_out, lm_head) or square."
    )
    m: int
    n: int
    k: int
    dtype: str
    seconds: float = Field(gt=0, description="Median time of one call.")
    repeats: int
    tflops: float = Field(gt=0, description="2·m·n·k / seconds / 1e12.")


class AttentionResult(BaseModel):
    """Causal `scaled_dot_product_attention` forward and backward of `batch` × `heads` sequences."""

    model_config = _STRICT

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    dtype: str
    forward_s: float = Field(gt=0)
    backward_s: float = Field(gt=0)
    forward_flops: float = Field(gt=0, description="Causal forward FLOPs: 2·batch·heads·s²·head_dim.")
    forward_tflops: float = Field(gt=0)
    backward_over_forward: float = Field(gt=0, description="Measured backward time / forward time.")


class BandwidthResult(BaseModel):
    """A large element-wise op: bytes read plus bytes written per call."""

    model_config = _STRICT

    op: str = Field(description="copy (read 1, write 1) or add (read 2, write 1).")
    elements: int
    dtype: str
    bytes_moved: int
    seconds: float = Field(gt=0)
    gb_per_s: float = Field(gt=0)


class LaunchResult(BaseModel):
    """Per-op host overhead: a chain of ops on a one-element tensor, where the math costs nothing."""

    model_config = _STRICT

    ops: int = Field(description="Ops in the timed chain.")
    no_grad_us_per_op: float = Field(gt=0, description="Forward only, autograd off.")
    autograd_us_per_kernel: float = Field(
        gt=0, description="Forward + backward with autograd, per kernel (1 forward + 2 backward per op)."
    )


class AdamResult(BaseModel):
    """torch AdamW step on fp32 host parameters (what an offloaded optimizer does, per step)."""

    model_config = _STRICT

    params: int
    impl: str = Field(description="torch AdamW variant timed (fused, foreach or for-loop).")
    threads: int
    seconds: float = Field(gt=0)
    gparams_per_s: float = Field(gt=0)


class CollectiveResult(BaseModel):
    """One collective among local processes (CPU proxy workers), median time of one call."""

    model_config = _STRICT

    op: str
    backend: str
    world: int
    elements: int
    bytes: int
    seconds: float = Field(gt=0)
    repeats: int


class Profile(BaseModel):
    """Everything `python -m service profile` measured, and the catalog fields derived from it."""

    model_config = _STRICT

    version: int = 1
    device: DeviceInfo
    model: str = Field(description="Model whose matmul shapes and head size were timed.")
    dtype: str = Field(description="Precision the model shapes were timed in (the proxies' precision).")
    budget_s: float = Field(gt=0)
    wall_s: float = Field(ge=0)
    base_gpu: str = Field(description="Catalog entry the overrides apply to.")
    gemm: list[GemmResult]
    attention: list[AttentionResult]
    bandwidth: list[BandwidthResult]
    launch: LaunchResult
    adam: AdamResult | None = None
    collectives: list[CollectiveResult] = Field(default_factory=list)
    overrides: dict[str, float] = Field(description="GPUSpec fields measured here (see derive.py).")
    fit: dict[str, float] = Field(
        default_factory=dict, description="Intermediate numbers of the derivation, for the reader."
    )
    notes: list[str] = Field(default_factory=list)

    def gpu_overrides(self) -> dict[str, float]:
        """The `GPUSpec` fields this profile measured, to lay over a catalog entry."""
        return dict(self.overrides)

    def gpu_spec(self, base: GPUSpec | None = None) -> GPUSpec:
        """`base` (default: the catalog's `base_gpu`) with the measured fields, validated."""
        from service.catalog import load_gpu
        from service.profile.derive import fused_attention_override

        base = base or load_gpu(self.base_gpu)
        overrides = dict(self.overrides)
        if "attention_efficiency" in overrides and "fused_attention_efficiency" not in overrides:
            overrides.update(fused_attention_override(base, overrides["attention_efficiency"]))
        return validate_as(GPUSpec, {**base.model_dump(), **overrides}, "profile overrides")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, width=110)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_yaml())
        return p


def load_profile(path: str | Path) -> Profile:
    """A profile written by `python -m service profile --out PATH`; bad files are a one-line SpecError."""
    from service.spec.experiment import read_yaml

    return validate_as(Profile, read_yaml(path), str(path))
