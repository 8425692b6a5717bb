"""`ExperimentSpec`: one YAML file naming the model, cluster, workload, budget, proxy and tracking."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.spec.errors import SpecError, validate_as
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.names import name_problem
from service.spec.plan import Engine
from service.spec.production import GoodputSpec, GPUAlternative, OptimizerSpec
from service.spec.proxy import ProxySpec
from service.spec.tracking import TrackingSpec
from service.spec.workload import MEGATRON_DEFAULT_RECOMPUTE_MODULES, Budget, Workload


class ExperimentSpec(BaseModel):
    """Everything needed to plan, proxy and search one production run.

    Example (YAML):
        name: llama2-13b-32xh100
        model: llama2-13b            # catalog name, a path to a ModelSpec YAML, or inline fields
        cluster: {gpu: h100-sxm-80gb, num_nodes: 4, gpus_per_node: 8}
        workload: {seq_len: 4096, global_batch_sequences: 128, tokens_to_train: 2.0e9}
        budget: {max_dollars: 1000, max_hours: 12}
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Experiment name (MLflow experiment, report titles).")
    model: ModelSpec = Field(
        description="Catalog name, path to a YAML with ModelSpec fields, or inline fields."
    )
    cluster: ClusterSpec = Field(description="The production cluster.")
    workload: Workload = Field(description="Sequence length, global batch, tokens to train.")
    budget: Budget = Field(default_factory=Budget, description="Dollar and hour limits, objective.")  # type: ignore[arg-type]
    proxy: ProxySpec = Field(default_factory=ProxySpec, description="How proxy runs scale the model down.")  # type: ignore[arg-type]
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow settings.")  # type: ignore[arg-type]
    goodput: GoodputSpec = Field(
        default_factory=GoodputSpec,  # type: ignore[arg-type]
        description="Interruption rate, checkpoint storage bandwidth, restart time (cited defaults).",
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec,  # type: ignore[arg-type]
        description="AdamW and its warmup-cosine schedule in the production DeepSpeed config.",
    )
    alternatives: list[GPUAlternative] = Field(
        default_factory=list, description="Other GPU types / clusters compared under the same budget."
    )
    engines: list[Engine] = Field(
        default_factory=lambda: list[Engine](["deepspeed"]),
        min_length=1,
        description="Engines whose plans the planner searches and ranks together, each under its own "
        "rules: deepspeed (the one the service runs), fsdp and megatron (scored analytically).",
    )

    quantized_collectives: bool = Field(
        False,
        description="Let the planner choose ZeRO++'s quantized collectives (int8 weight gathers, int4 "
        "gradient reduction; DeepSpeed ZeRO-3). Off by default: they change the numbers a step computes, "
        "and their quantization kernels are not priced.",
    )

    @field_validator("name")
    @classmethod
    def _folder_safe_name(cls, value: str) -> str:
        # The name becomes a folder (ray_results/run/<name>) and an MLflow experiment: it must stay one
        # folder inside the storage root.
        problem = name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("engines")
    @classmethod
    def _distinct_engines(cls, value: list[Engine]) -> list[Engine]:
        if len(set(value)) != len(value):
            raise ValueError(f"engines listed twice: {value}")
        return value

    @model_validator(mode="after")
    def _proxy_is_smaller(self) -> ExperimentSpec:
        if self.proxy.num_layers > self.model.num_layers:
            raise SpecError(
                "proxy.num_layers",
                f"{self.proxy.num_layers} is more than the model's {self.model.num_layers} layers; allowed: "
                f"1 to {self.model.num_layers} (a proxy is the model scaled down)",
            )
        return self

    @model_validator(mode="after")
    def _worker_runs_its_recompute(self) -> ExperimentSpec:
        # The DeepSpeed plans' proxies and production run on this service's worker, which checkpoints the
        # attention sub-block (train/model.py); the other policies describe other frameworks' runs.
        kind = self.workload.selective_recompute
        if "deepspeed" in self.engines and kind != "attention_block":
            raise SpecError(
                "workload.selective_recompute",
                f"{kind!r} is not what the service's DeepSpeed worker runs (attention_block); it describes "
                "other frameworks' runs for estimate and calibrate, or plans of engines [fsdp] or [megatron]",
            )
        modules = self.workload.recompute_modules
        if set(modules) != set(MEGATRON_DEFAULT_RECOMPUTE_MODULES) and "megatron" not in self.engines:
            raise SpecError(
                "workload.recompute_modules",
                f"{list(modules)} is Megatron-Core's selective recompute, and this experiment plans "
                f"{list(self.engines)}; allowed: the default [core_attn], or add megatron to engines",
            )
        if self.workload.moe_dispatcher != "alltoall" and "megatron" not in self.engines:
            raise SpecError(
                "workload.moe_dispatcher",
                f"{self.workload.moe_dispatcher!r} is Megatron-Core's flex dispatcher, and this experiment "
                f"plans {list(self.engines)}; allowed: alltoall, or add megatron to engines",
            )
        if self.workload.cuda_graph_scope and "megatron" not in self.engines:
            raise SpecError(
                "workload.cuda_graph_scope",
                f"{list(self.workload.cuda_graph_scope)} is Megatron-Core's CUDA-graph capture, and this "
                f"experiment plans {list(self.engines)}; allowed: [], or add megatron to engines",
            )
        return self

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, value: Any) -> Any:
        if isinstance(value, str):
            from service.spec.entries import load_model

            return load_model(value)
        return value


def read_text(path: str | Path, field: str = "path", kind: str = "file") -> str:
    """A user's text file as a string: a missing file, a folder, an unreadable file or one that is not
    UTF-8 text (binary, UTF-16, Latin-1) is a one-line `SpecError` naming it; so is a `path` that is no
    path at all (None, a number, a dict), which `Path` would raise `TypeError` for."""
    if not isinstance(path, str | os.PathLike):
        raise SpecError(field, f"expected a file path, got {type(path).__name__}")
    p = Path(path)
    if p.is_dir():
        raise SpecError(field, f"a directory, not a {kind}", str(path))
    if not p.is_file():
        raise SpecError(field, "no such file", str(path))
    try:
        data = p.read_bytes()
    except OSError as err:
        raise SpecError(field, f"cannot be read: {err.strerror or err}", str(path)) from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in data:
        raise SpecError(field, "not UTF-8 text (binary or UTF-16); save it as UTF-8", str(path))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError(
            field,
            f"not UTF-8 text (byte {err.start}: {data[err.start : err.start + 1]!r}); save it as UTF-8",
            str(path),
        ) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: plain YAML keeps the last one, so
    `zero_stage: [0, 1, 3]` followed by `zero_stage: [3]` would search one stage without a word."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: construct_mapping merges it
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # an unhashable key: construct_mapping says so itself
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: str | Path) -> Any:
    """Reads a YAML file; a missing, unreadable, non-UTF-8 or malformed file, or one that gives a key twice
    in a mapping, is a `SpecError` naming it."""
    text = read_text(path, kind="YAML file")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds no Python objects
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        problem = getattr(err, "problem", None) or getattr(err, "reason", None) or err
        raise SpecError(where, f"not valid YAML: {problem}", str(path)) from None
    except RecursionError:  # deeply nested flow collections ([[[[...): PyYAML recurses per level
        raise SpecError("(file)", "not valid YAML: nested too deeply", str(path)) from None


def load_experiment(path: str | Path) -> ExperimentSpec:
    """Reads and validates an experiment YAML; errors name the file and the field."""
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise SpecError("(top level)", "expected a mapping of experiment fields", str(path))
    model = data.get("model")
    if isinstance(model, str) and not Path(model).is_absolute():
        # A model file (ModelSpec YAML, a Hugging Face config.json or its folder) is looked up next to
        # the experiment that names it; a bare name is a catalog model.
        beside = Path(path).parent / model
        if model.lower().endswith((".yaml", ".yml", ".json")) or beside.is_dir():
            data = {**data, "model": str(beside)}
    try:
        return validate_as(ExperimentSpec, data, str(path))
    except SpecError as err:
        raise SpecError(err.field, err.message, err.source or str(path)) from None
