"""`PlanRequest`: one plan on a cluster given by its GPU count, as `estimate` takes it.

The layout's degrees (tp, pp, cp, ep, ...) with dp derived from the GPU count, dp = gpus / (tp·pp·cp),
and the global batch from the plan, micro_batch · grad_accum · dp sequences. `resolve()` loads the model
and the GPU, checks what the flags can get wrong and returns the validated (model, cluster, plan,
workload); every problem is one `SpecError` naming a field of this request (`PLAN_FIELDS` maps the
plan's own field names to it), so the CLI only prefixes `--`.

    >>> from service.spec.request import PlanRequest
    >>> model, cluster, plan, workload = PlanRequest(
    ...     model="llama2-13b", gpu="h100-sxm-80gb", gpus=32, zero=3, grad_accum=4
    ... ).resolve()
    >>> plan.short()
    'dp32-tp1-pp1-z3-mb1-ga4-rc:none'
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.spec.engine import Engine
from service.spec.errors import SpecError, validate_as
from service.spec.hardware import MAX_GPUS, ClusterSpec, LinkOverride, PriceOverride
from service.spec.model import ModelSpec
from service.spec.plan import Plan, Precision, Recompute, ZeroStage
from service.spec.plan_checks import allowed_values, plan_problem
from service.spec.workload import (
    MAX_SEQ_LEN,
    MEGATRON_DEFAULT_RECOMPUTE_MODULES,
    CudaGraphScope,
    MoEDispatcher,
    RecomputeModule,
    SelectiveRecompute,
    Workload,
)

# A plan (or workload) field -> the request field a user changes to fix it; the others share a name.
PLAN_FIELDS = {
    "dp": "gpus",
    "zero_stage": "zero",
    "zero_hpz_partition_size": "zero_hpz",
    "global_batch_sequences": "micro_batch",
}
DEFAULT_HEADROOM = 0.10


class PlanRequest(BaseModel):
    """What `estimate` is asked: a model and a GPU type by name, a GPU count, a layout, a workload."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        description="Catalog name, a ModelSpec YAML or a Hugging Face config (file or folder)."
    )
    gpu: str = Field(description="Catalog GPU name.")
    gpus: int = Field(gt=0, description="Total GPUs: a whole number of nodes, or fewer than one node.")
    gpus_per_node: int = Field(8, gt=0)
    price_per_gpu_hour: PriceOverride | None = Field(None, description="USD; default: the catalog's price.")
    inter_node_bandwidth: LinkOverride | None = Field(None, description="GB/s per GPU; default: catalog")
    # the layout
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    cp: int = Field(1, gt=0)
    ep: int = Field(1, gt=0)
    expert_tp: int = Field(1, gt=0)
    ep_comm_overlap: bool = False
    engine: Engine = "deepspeed"
    virtual_stages: int = Field(1, gt=0)
    zero: ZeroStage = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    zero_hpz: int = Field(1, gt=0)
    shard_group_size: int = 0
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    micro_batch: int = Field(1, gt=0)
    grad_accum: int = Field(1, gt=0)
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    comm_overlap: bool = False
    tp_comm_overlap: bool = False
    precision: Precision = "bf16"
    # the workload
    seq_len: int = Field(4096, gt=0)
    tokens_to_train: float = Field(1e9, le=1e16, allow_inf_nan=False)
    flash_attention: bool = True
    cudnn_attention: bool = True
    fused_elementwise: bool = False
    fused_cross_entropy: bool = False
    selective_recompute: SelectiveRecompute = "attention_block"
    recompute_modules: tuple[RecomputeModule, ...] = MEGATRON_DEFAULT_RECOMPUTE_MODULES
    moe_dispatcher: MoEDispatcher = "alltoall"
    cuda_graph_scope: tuple[CudaGraphScope, ...] = ()
    grad_reduce_in_fp32: bool = False
    moe_load_imbalance: float | None = None
    headroom: float = DEFAULT_HEADROOM

    @property
    def dp(self) -> int:
        return max(1, self.gpus // (self.tp * self.pp * self.cp))

    def resolve(self) -> tuple[ModelSpec, ClusterSpec, Plan, Workload]:
        """(model, cluster, plan, workload), validated; `SpecError` naming this request's field."""
        self._check_ranges()
        model = self._model()
        if model.moe is None and self.moe_load_imbalance is not None:
            raise SpecError("moe_load_imbalance", f"{model.name} has no experts; allowed: MoE models only")
        cluster = self._cluster()
        values = self._plan_values()
        if self.gpus % (self.tp * self.pp * self.cp):
            field = "pp" if self.gpus % self.pp else "cp" if self.gpus % self.cp else "tp"
            message = f"tp·pp·cp = {self.tp * self.pp * self.cp} does not divide gpus {self.gpus}"
            raise SpecError(field, message + _allowed(field, values, model, cluster))
        workload = self._workload(values)
        problem = plan_problem(Plan.model_construct(**values), model, cluster, workload)
        if problem:
            field, message = problem
            raise SpecError(PLAN_FIELDS.get(field, field), message + _allowed(field, values, model, cluster))
        return model, cluster, Plan(**values), workload

    def _check_ranges(self) -> None:
        """Bounds a typo can break, each said with what is allowed."""
        if self.gpus > MAX_GPUS:
            raise SpecError("gpus", f"{self.gpus:,} GPUs; allowed: at most {MAX_GPUS:,}")
        if self.seq_len > MAX_SEQ_LEN:
            raise SpecError("seq_len", f"{self.seq_len:,} tokens; allowed: at most {MAX_SEQ_LEN:,}")
        if self.price_per_gpu_hour is not None and self.price_per_gpu_hour < 0:
            raise SpecError("price_per_gpu_hour", f"must be 0 or more, got {self.price_per_gpu_hour}")
        bandwidth = self.inter_node_bandwidth
        if bandwidth is not None and bandwidth <= 0:
            raise SpecError("inter_node_bandwidth", f"must be more than 0 GB/s, got {bandwidth}")
        if self.shard_group_size < 0:
            raise SpecError("shard_group_size", f"must be 0 (off) or more, got {self.shard_group_size}")
        if not 0 <= self.headroom < 1:
            raise SpecError("headroom", f"must be in [0, 1), got {self.headroom}")
        if self.tokens_to_train <= 0:
            raise SpecError("tokens_to_train", f"must be positive, got {self.tokens_to_train:g}")

    def _model(self) -> ModelSpec:
        from service.spec.entries import load_model

        try:
            return load_model(self.model)
        except SpecError as err:
            raise _as_field("model", err) from None

    def _cluster(self) -> ClusterSpec:
        from service.spec.entries import load_gpu

        try:
            cluster = ClusterSpec.from_gpu_count(load_gpu(self.gpu), self.gpus, self.gpus_per_node)
        except SpecError as err:
            raise _as_field("gpu", err) from None
        except ValueError as err:
            raise SpecError("gpus", f"{err}; allowed: a multiple of {self.gpus_per_node}, or fewer") from None
        if self.price_per_gpu_hour is not None:
            cluster = cluster.model_copy(update={"price_per_gpu_hour_usd": self.price_per_gpu_hour})
        if self.inter_node_bandwidth is not None:
            # Validated, not model_copy'd: the validator carries the rate into the GPU spec the model reads.
            update = {"inter_node_bandwidth_gb_per_s": self.inter_node_bandwidth}
            cluster = ClusterSpec.model_validate({**cluster.model_dump(), **update})
        return cluster

    def _plan_values(self) -> dict[str, Any]:
        return dict(
            dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, zero_stage=self.zero,
            offload_optimizer=self.offload_optimizer, offload_params=self.offload_params,
            micro_batch=self.micro_batch, grad_accum=self.grad_accum, recompute=self.recompute,
            sequence_parallel=self.sequence_parallel, precision=self.precision,
            virtual_stages=self.virtual_stages, engine=self.engine,
            zero_hpz_partition_size=self.zero_hpz, shard_group_size=self.shard_group_size,
            zero_quantized_weights=self.zero_quantized_weights,
            zero_quantized_gradients=self.zero_quantized_gradients,
            comm_overlap=self.comm_overlap, tp_comm_overlap=self.tp_comm_overlap,
            ep=self.ep, expert_tp=self.expert_tp, ep_comm_overlap=self.ep_comm_overlap,
        )  # fmt: skip

    def _workload(self, values: dict[str, Any]) -> Workload:
        batch = self.micro_batch * self.grad_accum * values["dp"]
        if self.tokens_to_train < batch * self.seq_len:
            # Less than one step: the hours would be a fraction of the step time printed beside them.
            raise SpecError(
                "tokens_to_train",
                f"{self.tokens_to_train:g} is less than one optimizer step: micro_batch × grad_accum × dp × "
                f"seq_len = {batch * self.seq_len:,} tokens (dp {values['dp']} from gpus); allowed: at "
                "least that many",
            )
        data: dict[str, Any] = dict(
            seq_len=self.seq_len,
            global_batch_sequences=batch,
            tokens_to_train=self.tokens_to_train,
            flash_attention=self.flash_attention,
            cudnn_attention=self.cudnn_attention,
            fused_elementwise=self.fused_elementwise,
            fused_cross_entropy=self.fused_cross_entropy,
            selective_recompute=self.selective_recompute,
            recompute_modules=self.recompute_modules,
            moe_dispatcher=self.moe_dispatcher,
            cuda_graph_scope=self.cuda_graph_scope,
            grad_reduce_in_fp32=self.grad_reduce_in_fp32,
        )
        if self.moe_load_imbalance is not None:
            data["moe_load_imbalance"] = self.moe_load_imbalance
        try:
            workload = validate_as(Workload, data)
        except SpecError as err:
            raise SpecError(PLAN_FIELDS.get(err.field, err.field), err.message) from None
        megatron_only = {
            "recompute_modules": set(self.recompute_modules) != set(MEGATRON_DEFAULT_RECOMPUTE_MODULES),
            "moe_dispatcher": self.moe_dispatcher != "alltoall",
            "cuda_graph_scope": bool(self.cuda_graph_scope),
            "grad_reduce_in_fp32": self.grad_reduce_in_fp32,
        }
        for field, given in megatron_only.items():
            if given and self.engine != "megatron":
                raise SpecError(
                    field,
                    f"{getattr(self, field)} is Megatron-Core's and the plan's engine is {self.engine}; "
                    f"allowed: the default ({Workload.model_fields[field].default}), or engine megatron",
                )
        return workload


def _as_field(field: str, err: SpecError) -> SpecError:
    """A catalog lookup's error as this request's `field`'s, unless it names the file at fault."""
    return err if err.source else SpecError(field, err.message)


def _allowed(field: str, values: dict[str, Any], model: ModelSpec, cluster: ClusterSpec) -> str:
    """The values of a layout `field` (tp, pp, cp) that would pass, other fields unchanged; '' otherwise."""
    if field not in ("tp", "pp", "cp"):
        return ""
    ok = allowed_values(field, Plan.model_construct(**values), model, cluster)
    return f"; allowed {field} for this model and cluster: {', '.join(map(str, ok)) or 'none'}"
