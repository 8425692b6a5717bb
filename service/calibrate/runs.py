"""Tables of measured training runs, the input of the calibration: the published set
(benchmarks/published/measurements.yaml), a user's own past runs, proxy runs.

A runs file is YAML in the published set's format (`sources`, optional inline `models`,
`measurements`: one row per run with its layout as `Plan` fields and exactly one `measured` value), or
a CSV with one row per run and the columns id, source, model, gpu, num_gpus, gpus_per_node, dp, tp,
pp, zero_stage, micro_batch, grad_accum, global_batch, seq_len, recompute and one of
tokens_per_s_per_gpu / step_time_s. Each row becomes a `MeasuredRun`: the specs the cost model takes
and the measured tokens/s per GPU, converted with the source's own formula. A bad row is a one-line
`SpecError` naming the file, the row and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.calibrate.runs_csv import csv_dataset
from service.calibrate.source_flops import FLOPS_PER_TOKEN, FlopsFormula
from service.catalog import load_gpu, load_model
from service.spec import ClusterSpec, GPUSpec, ModelSpec, Plan, SpecError, Workload, plan_problem
from service.spec.errors import validate_as
from service.spec.plan import Engine
from service.spec.plan_table import PlanTable
from service.spec.workload import (
    MEGATRON_DEFAULT_RECOMPUTE_MODULES,
    CudaGraphScope,
    MoEDispatcher,
    RecomputeModule,
    SelectiveRecompute,
)


class Source(BaseModel):
    """Where a group of measurements comes from and how it defines its numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    citation: str
    framework: str
    metric: str
    mfu_definition: str = ""
    flops_formula: str = ""
    read_via: str = ""
    engine: Engine = Field("deepspeed", description="What ran its rows (a row may say otherwise).")
    fused_elementwise: bool = Field(
        False, description="Its model code fused the element-wise ops (Workload.fused_elementwise)."
    )
    flash_attention: bool = Field(
        True, description="Its attention kept no s×s scores (Workload.flash_attention); false = materialised."
    )
    fused_cross_entropy: bool = Field(
        False, description="Its loss kept no logits (Workload.fused_cross_entropy: Liger's fused linear CE)."
    )
    cudnn_attention: bool = Field(
        False,
        description="Its attention ran cuDNN's fused kernel or one as fast (Workload.cudnn_attention): torch "
        "SDPA from 2.11, FlashAttention-3; false = FlashAttention-2, what runs before 2026 ran (Transformer "
        "Engine: cuDNN regardless).",
    )


class Measured(BaseModel):
    """Exactly one measured quantity, in the source's own terms."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    tokens_per_s_per_gpu: float | None = Field(None, gt=0)
    step_time_s: float | None = Field(None, gt=0)
    tflops_per_gpu: float | None = Field(None, gt=0)
    mfu: float | None = Field(None, gt=0, le=1)
    flops_formula: FlopsFormula | None = None
    peak_tflops: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_value(self) -> Measured:
        given = [
            k for k in ("tokens_per_s_per_gpu", "step_time_s", "tflops_per_gpu", "mfu") if getattr(self, k)
        ]
        if len(given) != 1:
            raise ValueError(f"give exactly one measured value, got {given or 'none'}")
        if (self.tflops_per_gpu or self.mfu) and self.flops_formula is None:
            raise ValueError("tflops_per_gpu and mfu need flops_formula")
        if self.mfu and self.peak_tflops is None:
            raise ValueError("mfu needs peak_tflops")
        return self


class Measurement(BaseModel):
    """One published run: its layout, as `Plan` fields, and what it measured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    source: str
    ref: str = Field("", description="Where the number is printed (the published set cites every row).")
    model: str
    gpu: str
    gpu_overrides: dict[str, float] = Field(default_factory=dict)
    num_gpus: int = Field(gt=0)
    gpus_per_node: int = Field(8, gt=0)
    dp: int = Field(gt=0)
    tp: int = Field(gt=0)
    pp: int = Field(gt=0)
    cp: int = Field(1, gt=0, description="Context-parallel degree (1 = whole sequences per rank).")
    zero_stage: Literal[0, 1, 2, 3]
    micro_batch: int = Field(gt=0)
    grad_accum: int = Field(gt=0)
    global_batch: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    recompute: Literal["none", "selective", "full"]
    sequence_parallel: bool = False
    virtual_stages: int = Field(1, gt=0)
    comm_overlap: bool = Field(False, description="Megatron-Core's pipeline/DP overlaps (Plan.comm_overlap).")
    tp_comm_overlap: bool = Field(False, description="Megatron-Core's TP overlap (Plan.tp_comm_overlap).")
    shard_group_size: int = Field(0, ge=0, description="ZeRO-3 shard group: FSDP's HSDP (0 = off).")
    offload_optimizer: bool = Field(False, description="Optimizer on the host (Plan.offload_optimizer).")
    offload_params: bool = Field(False, description="Parameters on the host (Plan.offload_params).")
    zero_hpz_partition_size: int = Field(1, gt=0, description="ZeRO++ hpZ (Plan.zero_hpz_partition_size).")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ (Plan.zero_quantized_weights).")
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ (Plan.zero_quantized_gradients).")
    engine: Engine | None = Field(None, description="What ran it; default: its source's engine.")
    zero3_collectives: Literal["flat", "per_tensor_lists"] = Field(
        "flat", description="How its ZeRO-3 called collectives (Workload.zero3_collectives)."
    )
    selective_recompute: SelectiveRecompute = Field(
        "attention_block",
        description="What its selective recompute checkpointed (Workload.selective_recompute).",
    )
    recompute_modules: tuple[RecomputeModule, ...] = Field(
        MEGATRON_DEFAULT_RECOMPUTE_MODULES,
        description="Megatron-Core's --recompute-modules (Workload.recompute_modules).",
    )
    moe_dispatcher: MoEDispatcher = Field(
        "alltoall", description="How its MoE blocks sent tokens (Workload.moe_dispatcher)."
    )
    cuda_graph_scope: tuple[CudaGraphScope, ...] = Field(
        (), description="What it replayed from CUDA graphs (Workload.cuda_graph_scope)."
    )
    precision: Literal["bf16", "fp16", "fp8"] = "bf16"
    ep: int = Field(1, gt=0, description="Expert-parallel degree (Plan.ep; MoE models).")
    expert_tp: int = Field(1, gt=0, description="Expert tensor-parallel degree (Plan.expert_tp).")
    ep_comm_overlap: bool = Field(
        False, description="Megatron-Core's MoE all-to-all overlap (Plan.ep_comm_overlap)."
    )
    moe_load_imbalance: float | None = Field(
        None,
        ge=1.0,
        description="Busiest expert over its share (Workload.moe_load_imbalance); 1 for a run "
        "with force-balanced routing; default: the Workload default.",
    )
    capacity_factor: float | None = Field(
        None,
        ge=1.0,
        description="The run dropped tokens at this capacity factor (the model's router "
        "becomes 'capacity'); default: the model's own router.",
    )
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="What the source states that the cost model does not read "
        "(dispatcher, CUDA graphs, software versions).",
    )
    measured: Measured
    reported_mfu: float | None = None
    approximate: bool = False
    assumptions: list[str] = Field(default_factory=list)
    notes: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Measurement:
        if self.dp * self.tp * self.pp * self.cp != self.num_gpus:
            gpus = self.dp * self.tp * self.pp * self.cp
            raise ValueError(f"dp·tp·pp·cp = {gpus} but num_gpus = {self.num_gpus}")
        if self.micro_batch * self.grad_accum * self.dp != self.global_batch:
            raise ValueError("micro_batch·grad_accum·dp != global_batch")
        return self

    def plan_fields(self) -> dict[str, Any]:
        keys: tuple[str, ...] = ("dp", "tp", "pp", "cp", "zero_stage", "micro_batch", "grad_accum")
        keys += ("recompute", "sequence_parallel", "virtual_stages", "precision", "comm_overlap")
        keys += ("tp_comm_overlap", "shard_group_size", "offload_optimizer", "offload_params")
        keys += ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
        keys += ("ep", "expert_tp", "ep_comm_overlap")
        return {k: getattr(self, k) for k in keys}


class Dataset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: dict[str, Source]
    models: dict[str, dict[str, Any]] = Field(default_factory=dict)
    measurements: list[Measurement] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_sources(self) -> Dataset:
        ids = [m.id for m in self.measurements]
        if len(set(ids)) != len(ids):
            raise ValueError("measurement ids must be unique")
        for m in self.measurements:
            if m.source not in self.sources:
                raise ValueError(f"{m.id}: unknown source {m.source!r}")
        return self


def model_spec(ds: Dataset, name: str, capacity_factor: float | None = None) -> ModelSpec:
    """An inline model from the data file (its bookkeeping keys dropped), else a catalog model; with
    `capacity_factor`, its MoE router drops tokens at that factor (a run's own router setting)."""
    if name in ds.models:
        fields = {k: v for k, v in ds.models[name].items() if k not in ("source", "source_num_params")}
        model = ModelSpec(name=name, **fields)
    else:
        model = load_model(name)
    if capacity_factor is not None and model.moe is not None:
        router = {"router": "capacity", "capacity_factor": capacity_factor}
        model = model.model_copy(update={"moe": model.moe.model_copy(update=router)})
    return model


def cluster_spec(row: Measurement) -> ClusterSpec:
    gpu = load_gpu(row.gpu)
    if row.gpu_overrides:
        gpu = GPUSpec.model_validate({**gpu.model_dump(), **row.gpu_overrides})
    nodes = max(1, row.num_gpus // row.gpus_per_node)
    if row.num_gpus > row.gpus_per_node and row.num_gpus % row.gpus_per_node:
        raise SpecError(
            "num_gpus",
            f"{row.num_gpus} GPUs are no whole number of {row.gpus_per_node}-GPU nodes; give the row's "
            "gpus_per_node as it ran",
        )
    return ClusterSpec(gpu=gpu, num_nodes=nodes, gpus_per_node=min(row.gpus_per_node, row.num_gpus))


def workload(ds: Dataset, row: Measurement) -> Workload:
    # tokens_to_train only sets hours and dollars, which this benchmark does not score.
    source = ds.sources[row.source]
    moe = {} if row.moe_load_imbalance is None else {"moe_load_imbalance": row.moe_load_imbalance}
    return Workload(
        **moe,
        seq_len=row.seq_len,
        global_batch_sequences=row.global_batch,
        tokens_to_train=1e9,
        flash_attention=source.flash_attention,
        cudnn_attention=source.cudnn_attention,
        fused_elementwise=source.fused_elementwise,
        fused_cross_entropy=source.fused_cross_entropy,
        zero3_collectives=row.zero3_collectives,
        selective_recompute=row.selective_recompute,
        recompute_modules=row.recompute_modules,
        moe_dispatcher=row.moe_dispatcher,
        cuda_graph_scope=row.cuda_graph_scope,
    )


def measured_tokens_per_s_per_gpu(row: Measurement, model: ModelSpec) -> float:
    """The measurement as tokens/s per GPU, converted with the source's own FLOP formula."""
    m = row.measured
    if m.tokens_per_s_per_gpu:
        return m.tokens_per_s_per_gpu
    if m.step_time_s:
        return row.global_batch * row.seq_len / (m.step_time_s * row.num_gpus)
    assert m.flops_formula is not None
    per_token = FLOPS_PER_TOKEN[m.flops_formula](model, row.seq_len)
    if m.tflops_per_gpu:
        return m.tflops_per_gpu * 1e12 / per_token
    assert m.mfu is not None and m.peak_tflops is not None
    return m.mfu * m.peak_tflops * 1e12 / per_token


class MeasuredRun(BaseModel):
    """One measured run: the specs the cost model scores and what was measured.

    `plan` is a validated `Plan` of the engine that ran the row (`row_plan`).
    """

    model_config = ConfigDict(frozen=True)

    id: str
    source: str
    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    plan: Plan
    tokens_per_s_per_gpu: float | None = Field(None, gt=0, description="Measured tokens/s per GPU.")
    activations_bytes: float | None = Field(
        None,
        gt=0,
        description="Measured saved activations per GPU, as the cost model's `activations` term counts "
        "them: logits excluded (subtract them from a meter that counts them).",
    )
    model_state_bytes: float | None = Field(
        None, gt=0, description="Measured params+grads+optimizer per GPU."
    )
    approximate: bool = False

    def plan_table(self) -> PlanTable:
        return PlanTable.from_plans([self.plan])


def row_plan(ds: Dataset, row: Measurement) -> Plan:
    """The row's layout as a validated `Plan` of the engine that ran it."""
    return Plan(**row.plan_fields(), engine=row.engine or ds.sources[row.source].engine)


def measured_run(ds: Dataset, row: Measurement) -> MeasuredRun:
    """The `MeasuredRun` of one row of a runs file."""
    model = model_spec(ds, row.model, row.capacity_factor)
    return MeasuredRun(
        id=row.id,
        source=row.source,
        model=model,
        cluster=cluster_spec(row),
        workload=workload(ds, row),
        plan=row_plan(ds, row),
        tokens_per_s_per_gpu=measured_tokens_per_s_per_gpu(row, model),
        approximate=row.approximate,
    )


def _above_peak(row: Measurement, model: ModelSpec, cluster: ClusterSpec) -> str | None:
    """Why the measurement cannot have been made (None when it can): its model FLOPs (costmodel.flops,
    active parameters for a MoE) outrun the GPU's dense peak in the row's precision."""
    from service.costmodel.flops import model_flops_per_token

    precision = "fp8" if row.precision == "fp8" and cluster.gpu.peak_tflops_fp8 else "bf16"
    peak = cluster.gpu.peak_tflops(precision)
    tokens_per_s = measured_tokens_per_s_per_gpu(row, model)
    implied = tokens_per_s * model_flops_per_token(model, row.seq_len) / 1e12
    if implied <= peak:
        return None
    return (
        f"row {row.id!r} implies {implied:,.0f} model TFLOP/s per GPU, above the {cluster.gpu.name}'s "
        f"{precision} peak of {peak:,.0f}: not a measurement this GPU can make"
    )


def load_dataset(path: str | Path) -> Dataset:
    """A runs file (YAML or CSV) as a validated `Dataset`; a bad row is a one-line `SpecError`."""
    from service.spec.experiment import read_yaml

    p = Path(path)
    if not p.is_file():
        raise SpecError("runs", "no such file", str(p))
    data = csv_dataset(p) if p.suffix.lower() == ".csv" else read_yaml(p)
    ds = validate_as(Dataset, data, str(p))
    for i, row in enumerate(ds.measurements):
        try:
            model = model_spec(ds, row.model, row.capacity_factor)
        except ValidationError as err:  # an inline model's own field, named as the file names it
            first = err.errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ())) or "(model)"
            message = str(first["msg"]).removeprefix("Value error, ")
            raise SpecError(f"models.{row.model}.{where}", f"{row.id}: {message}", str(p)) from None
        except SpecError as err:  # a model neither inline nor in the catalog
            raise SpecError(f"measurements.{i}.{err.field}", f"{row.id}: {err.message}", str(p)) from None
        try:
            cluster = cluster_spec(row)
            check = plan_problem(row_plan(ds, row), model, cluster)
            if check:
                raise SpecError(f"measurements.{i}.{check[0]}", f"{row.id}: {check[1]}", str(p))
            impossible = _above_peak(row, model, cluster)  # refused before it moves a fit
            if impossible:
                raise SpecError(f"measurements.{i}.measured", impossible, str(p))
        except ValidationError as err:  # Plan's own rules (what the row's engine can combine)
            message = str(err.errors()[0]["msg"]).removeprefix("Value error, ")
            raise SpecError(
                f"measurements.{i}.{message.split(':')[0]}", f"{row.id}: {message}", str(p)
            ) from None
        except SpecError as err:
            if err.field.startswith("measurements."):
                raise
            raise SpecError(f"measurements.{i}.{err.field}", f"{row.id}: {err.message}", str(p)) from None
    return ds


def load_runs(path: str | Path) -> list[MeasuredRun]:
    """Every row of a runs file as a `MeasuredRun`."""
    ds = load_dataset(path)
    return [measured_run(ds, row) for row in ds.measurements]


def with_profiles(runs: list[MeasuredRun], profile_paths: list[str | Path]) -> list[MeasuredRun]:
    """`runs` with each GPU that a profile measured (`python -m service profile`, its `base_gpu`) replaced
    by the profiled spec, so a fit on them captures the framework, not the catalog's error about the
    kernels. Runs on other GPU types are unchanged."""
    from service.profile import load_profile

    specs = {}
    for path in profile_paths:
        profile = load_profile(path)
        specs[profile.base_gpu] = profile.gpu_spec()
    return [
        r.model_copy(update={"cluster": r.cluster.model_copy(update={"gpu": specs[r.cluster.gpu.name]})})
        if r.cluster.gpu.name in specs
        else r
        for r in runs
    ]
