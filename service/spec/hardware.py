"""`GPUSpec` (a catalog entry) and `ClusterSpec` (how many of them, in how many nodes, at what price)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.spec.errors import SpecError


class GPUSpec(BaseModel):
    """One accelerator type, from public datasheets. Bandwidths are per GPU and per direction.

    `gemm_efficiency_max` and `attention_efficiency` are the fractions of peak that large bf16 matrix
    multiplies and fused (flash) attention reach on this part; each catalog file cites where its
    figure comes from. They are priors from kernel benchmarks, never fitted to training runs.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Catalog name, e.g. h100-sxm-80gb.")
    peak_tflops_bf16: float = Field(gt=0, description="Dense bf16 tensor-core peak (TFLOP/s).")
    peak_tflops_fp16: float = Field(gt=0, description="Dense fp16 tensor-core peak (TFLOP/s).")
    peak_tflops_fp32: float = Field(gt=0, description="fp32 peak without TF32 (TFLOP/s).")
    peak_tflops_fp8: float | None = Field(
        None, gt=0, description="Dense fp8 tensor-core peak (TFLOP/s); none = no FP8 tensor cores."
    )
    hbm_gib: float = Field(gt=0, description="Device memory (GiB).")
    hbm_bandwidth_gb_per_s: float = Field(gt=0, description="Device memory bandwidth (GB/s).")
    intra_node_bandwidth_gb_per_s: float = Field(
        gt=0, description="GPU-to-GPU bandwidth inside a node (NVLink), per GPU per direction (GB/s)."
    )
    inter_node_bandwidth_gb_per_s: float = Field(
        gt=0, description="Network bandwidth between nodes, per GPU per direction (GB/s)."
    )
    intra_node_latency_us: float = Field(
        5.0, ge=0, description="Latency of one intra-node collective step (µs)."
    )
    inter_node_latency_us: float = Field(
        15.0, ge=0, description="Latency of one inter-node collective step (µs)."
    )
    host_to_device_gb_per_s: float = Field(gt=0, description="PCIe bandwidth, per GPU per direction (GB/s).")
    cpu_adam_gparams_per_s: float = Field(
        gt=0,
        description="CPU Adam step throughput available per GPU when the optimizer is offloaded (Gparam/s).",
    )
    gemm_efficiency_max: float = Field(gt=0, le=1, description="Fraction of peak a large GEMM reaches.")
    fp8_gemm_efficiency_max: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of the FP8 peak a large FP8 GEMM reaches; None: as gemm_efficiency_max.",
    )
    attention_efficiency: float = Field(gt=0, le=1, description="Fraction of peak fused attention reaches.")
    fused_attention_efficiency: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of peak cuDNN's fused attention reaches over forward and backward (backward at "
        "2.5x the forward FLOPs), the kernel Transformer Engine (and so Megatron-Core) runs and "
        "FlashAttention-3 matches; used as measured, not scaled by the fit; None: as attention_efficiency "
        "(no faster kernel for this GPU).",
    )
    kernel_overhead_us: float = Field(
        4.0, ge=0, description="Launch and scheduling cost per kernel (µs), paid by small shapes."
    )
    sm_count: int | None = Field(
        None,
        gt=0,
        description="Streaming multiprocessors: what the kernels of a communication library that holds a "
        "fixed number of them (DeepEP) leave the compute beside it. None: not priced (CPU, inline specs).",
    )
    framework_overhead_gib: float = Field(
        gt=0, description="Memory the runtime takes before any tensor: CUDA context, allocator slack (GiB)."
    )
    price_per_gpu_hour_usd: float = Field(ge=0, description="Default on-demand price per GPU-hour (USD).")
    source: str = Field("", description="Where the figures come from.")

    @property
    def is_cpu(self) -> bool:
        """The CPU stand-in proxies run on (catalog `cpu` and its profiled copies): the host computes, so
        no device queue runs ahead of it or waits on it."""
        return self.name.split("-")[0] == "cpu"

    def peak_tflops(self, precision: str) -> float:
        """The peak MFU is quoted against: fp8 plans against bf16, since only their GEMMs run in fp8
        (service/costmodel/fp8.py) and MFU then compares with bf16 plans on one scale."""
        peaks = {"bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_fp16, "fp32": self.peak_tflops_fp32}
        return peaks["bf16" if precision == "fp8" else precision]


# The largest cluster a plan may describe: past every machine built (2024's largest runs used ~100k
# GPUs), and small enough that the plan enumeration and the cost model stay meaningful.
MAX_GPUS = 2**20
# Sanity bounds on the cluster's overrides: a link of 10 MB/s per GPU (a shared 1 Gb/s uplink for 8 GPUs
# and more) to 10 TB/s (ten times NVLink 5 per direction); a price of up to $10,000 per GPU-hour.
MIN_LINK_GB_PER_S = 0.01
MAX_LINK_GB_PER_S = 10_000.0
MAX_PRICE_PER_GPU_HOUR_USD = 10_000.0
# The override types, shared by the experiment's cluster and `estimate`'s flags (spec/request.py).
PriceOverride = Annotated[float, Field(ge=0, le=MAX_PRICE_PER_GPU_HOUR_USD, allow_inf_nan=False)]
LinkOverride = Annotated[float, Field(ge=MIN_LINK_GB_PER_S, le=MAX_LINK_GB_PER_S, allow_inf_nan=False)]


class ClusterSpec(BaseModel):
    """`num_nodes` × `gpus_per_node` GPUs of one type; `gpu` is a catalog name or an inline `GPUSpec`.

    Example:
        >>> ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8).num_gpus
        32
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu: GPUSpec = Field(description="GPU catalog name (see `python -m service catalog`) or inline spec.")
    num_nodes: int = Field(1, gt=0, le=MAX_GPUS, description="Nodes.")
    gpus_per_node: int = Field(8, gt=0, le=MAX_GPUS, description="GPUs per node.")
    price_per_gpu_hour_usd: PriceOverride | None = Field(
        None, description="Overrides the catalog's price per GPU-hour (USD)."
    )
    inter_node_bandwidth_gb_per_s: LinkOverride | None = Field(
        None,
        description="Overrides the catalog's network line rate per GPU between nodes (GB/s): the catalog "
        "assumes one 400 Gb/s NIC per H100 (50); a node with 800 Gb/s for its 8 GPUs is 12.5. Applied when "
        "the spec is validated (construct or model_validate it; model_copy(update=...) skips that).",
    )

    @model_validator(mode="after")
    def _network(self) -> ClusterSpec:
        if self.num_gpus > MAX_GPUS:
            raise SpecError(
                "num_nodes",
                f"{self.num_nodes} × {self.gpus_per_node} = {self.num_gpus:,} GPUs; allowed: at most "
                f"{MAX_GPUS:,} in all",
            )
        # Clouds often give a node a fraction of DGX's one NIC per GPU (fms-fsdp's H100s: 800 Gb/s per
        # node); every cost-model term reads the GPU spec, so the override lands there.
        bw = self.inter_node_bandwidth_gb_per_s
        if bw is not None and bw != self.gpu.inter_node_bandwidth_gb_per_s:
            gpu = self.gpu.model_copy(update={"inter_node_bandwidth_gb_per_s": bw})
            object.__setattr__(self, "gpu", gpu)
        return self

    @field_validator("gpu", mode="before")
    @classmethod
    def _resolve_gpu(cls, value: Any) -> Any:
        if isinstance(value, str):
            from service.spec.entries import load_gpu

            return load_gpu(value)
        return value

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def price_usd_per_gpu_hour(self) -> float:
        if self.price_per_gpu_hour_usd is not None:
            return self.price_per_gpu_hour_usd
        return self.gpu.price_per_gpu_hour_usd

    @classmethod
    def from_gpu_count(cls, gpu: str | GPUSpec, num_gpus: int, gpus_per_node: int = 8) -> ClusterSpec:
        """For CLIs that take a GPU count: checks that it divides into whole nodes."""
        if num_gpus <= 0:
            raise ValueError(f"gpus must be positive, got {num_gpus}")
        if num_gpus > MAX_GPUS:
            raise ValueError(f"{num_gpus:,} GPUs; allowed: at most {MAX_GPUS:,}")
        if num_gpus < gpus_per_node:
            return cls(gpu=gpu, num_nodes=1, gpus_per_node=num_gpus)  # type: ignore[arg-type]
        if num_gpus % gpus_per_node:
            raise ValueError(
                f"gpus {num_gpus} is not a whole number of nodes of gpus_per_node {gpus_per_node}"
            )
        return cls(gpu=gpu, num_nodes=num_gpus // gpus_per_node, gpus_per_node=gpus_per_node)  # type: ignore[arg-type]
