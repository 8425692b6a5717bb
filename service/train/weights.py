"""Fine-tuning the user's own weights: a local Hugging Face checkpoint folder in, the trained weights out.

- What cannot load is refused in one line before anything starts (service/train/checkpoint_checks.py).
- `load_causal_lm` (on every worker): `AutoModelForCausalLM.from_pretrained` for the plan's layout. Under
  ZeRO-3 it goes through DeepSpeed's own path for Hugging Face models: a `HfDeepSpeedConfig` (or, where
  `accelerate` is absent, an object with the same two methods transformers reads) is registered and kept
  alive, so `from_pretrained` builds the model inside `deepspeed.zero.Init` (every parameter partitioned
  as it is made) and copies the checkpoint in one module at a time from rank 0; no rank holds the whole
  model. ZeRO 0-2 replicate the model on every rank anyway, so each rank loads it whole.
- `load_tensor_parallel` (tp > 1, pp = cp = 1; with or without sequence parallelism): the service's
  own tensor-parallel model (`service.train.model.build_model`) built on the meta device from the
  checkpoint's config, then each rank reads only what it keeps with safetensors' lazy
  `safe_open(...).get_slice`: its rows of the column-parallel weights (q/k/v, gate/up, lm_head: the
  output dimension) and its columns of the row-parallel ones (o_proj, down_proj: the input dimension);
  the embedding, the norms (and a row-parallel layer's bias) whole, as the service's TP layers hold them.
- pp > 1 (with or without tp; service/train/weights_pp.py): the same meta model cut into stages that the
  `PipelineModule` builds only where they run, each reading only its own layers (and with tp > 1 its
  slices): the embedding on the first stage, the decoder layers of the module's partition, the final
  norm and lm_head on the last.
- `export_hf` (on every worker, after the last step): the trained weights gathered one parameter at a
  time onto rank 0 (`deepspeed.zero.GatheredParameters`; a no-op below ZeRO-3; with tensor parallelism
  each sharded parameter all-gathered over its TP group along the dimension it was split on and named as
  in the checkpoint, `tensor_parallel_state_dict`; with pp > 1 every stage's gathered onto global rank 0,
  `weights_pp.pipeline_state_dict`) in the dtype the engine
  computes in (bf16/fp16 plans: 16-bit, as DeepSpeed's `save_16bit_model` writes; an fp32 CPU run: fp32),
  written by `save_pretrained` with the checkpoint's tokenizer into a temporary folder renamed into place,
  so `hf_model/` is either complete or absent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

EXPORT_DIR = "hf_model"
PROBE_FILE = "hf_model_probe.pt"  # logits of the trained model on one evaluation sequence (tests compare)


class FineTune(BaseModel):
    """What a worker needs to fine-tune: sent by the driver inside `WorkerConfig.finetune`."""

    model_config = ConfigDict(extra="forbid")

    weights: str  # the checkpoint folder (config.json, safetensors, tokenizer)
    data_dir: str | None = None  # packed train.npy / eval.npy (service.train.hf_data); None: proxy.data
    eval_every: int = 0  # steps between evaluations (0: at the end only); needs data_dir
    export_dir: str  # where the trained weights go (`<run_dir>/hf_model`)


class _ZeroConfig:
    """What transformers reads from a registered `HfDeepSpeedConfig` (`is_zero3()`, `config`), for where
    `accelerate` (which `HfDeepSpeedConfig` requires) is not installed."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def is_zero3(self) -> bool:
        return int(self.config.get("zero_optimization", {}).get("stage", 0)) == 3

    def is_offload(self) -> bool:
        zero = self.config.get("zero_optimization", {})
        return any(
            zero.get(k, {}).get("device") in ("cpu", "nvme") for k in ("offload_param", "offload_optimizer")
        )


# The registered DeepSpeed config: transformers holds only a weak reference, so it is kept alive here
# for the life of the worker process (from_pretrained, and any later resize, must see it).
_KEEP_ALIVE: list[Any] = []


def register_zero3(ds_config: dict[str, Any]) -> Any:
    """Registers `ds_config` with transformers so that `from_pretrained` partitions at load (ZeRO-3)."""
    try:
        from transformers.integrations import HfDeepSpeedConfig

        registered: Any = HfDeepSpeedConfig(ds_config)
    except Exception:  # accelerate absent (HfDeepSpeedConfig checks for it): the same two methods
        from transformers.integrations.deepspeed import set_hf_deepspeed_config

        registered = _ZeroConfig(ds_config)
        set_hf_deepspeed_config(registered)
    _KEEP_ALIVE[:] = [registered]
    return registered


def load_causal_lm(weights: str, ds_config: dict[str, Any], dtype: torch.dtype) -> Any:
    """The checkpoint as a causal LM for the plan's layout (see the module docstring); under ZeRO-3 its
    parameters are already partitioned (on the accelerator zero.Init picks), else whole on the CPU."""
    from transformers import AutoModelForCausalLM

    from service.train.model import ATTN_IMPLEMENTATION

    zero3 = int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3
    if zero3:
        register_zero3(ds_config)
    model = AutoModelForCausalLM.from_pretrained(
        weights,
        dtype=dtype,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    model.config.use_cache = False
    if zero3 and not all(hasattr(p, "ds_id") for p in model.parameters()):
        raise RuntimeError(f"ZeRO-3: {weights} was loaded whole, not partitioned at load (zero.Init)")
    return model


def gathered_state_dict(module: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The full parameters and persistent buffers on rank 0 (CPU copies), one parameter gathered at a
    time; other ranks return {} (every rank must call it: under ZeRO-3 each gather is a collective)."""
    import deepspeed

    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                state[name] = param.detach().to("cpu", copy=True)
    if rank == 0:
        state.update(_persistent_buffers(module))
    return state


def _persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies of the buffers `state_dict` saves (rotary tables are not persistent)."""
    persistent = module.state_dict().keys()
    return {n: b.detach().to("cpu", copy=True) for n, b in module.named_buffers() if n in persistent}


class CheckpointReader:
    """Lazy reads from a checkpoint's safetensors file(s) (`model.safetensors`, or the shards that
    `model.safetensors.index.json` names): a whole tensor, or one rank's slice of it along a dimension,
    read with `safe_open(...).get_slice` so that only that slice leaves the file."""

    def __init__(self, weights: str | Path):
        self.folder = Path(weights)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self.files = dict(weight_map)
        else:
            from safetensors import safe_open

            with safe_open(str(self.folder / "model.safetensors"), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), "model.safetensors")
        self._open: dict[str, Any] = {}

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{self.folder} has no tensor {name!r}")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.folder / file), framework="pt")
        return self._open[file]

    def read(
        self, name: str, dtype: torch.dtype, dim: int | None = None, rank: int = 0, parts: int = 1
    ) -> torch.Tensor:
        """Tensor `name` in `dtype`: whole (`dim` None), else chunk `rank` of `parts` equal chunks along
        `dim` (what `torch.chunk` gives, as the service's TP layers split)."""
        piece = self._handle(name).get_slice(name)
        if dim is None:
            return piece[:].to(dtype).contiguous()  # type: ignore[no-any-return]
        size = piece.get_shape()[dim]
        if size % parts:
            raise ValueError(f"{name}: dimension {dim} ({size}) is not divisible by tp {parts}")
        step = size // parts
        index = [slice(None)] * len(piece.get_shape())
        index[dim] = slice(rank * step, (rank + 1) * step)
        return piece[tuple(index)].to(dtype).contiguous()  # type: ignore[no-any-return]


def tensor_parallel_shards(lm: torch.nn.Module) -> dict[str, tuple[int, Any]]:
    """{parameter name: (dimension it is split on, TP group)} for the sharded parameters of a model
    whose linears `apply_tensor_parallel` replaced: column-parallel weight and bias on dim 0 (output
    features), row-parallel weight on dim 1 (input features); a row-parallel bias and everything else
    is whole on every rank."""
    from service.train import tensor_parallel as tpl

    shards: dict[str, tuple[int, Any]] = {}
    for prefix, module in lm.named_modules():
        if isinstance(module, tpl.ColumnParallelLinear):
            shards[f"{prefix}.weight"] = (0, module.group)
            if module.bias is not None:
                shards[f"{prefix}.bias"] = (0, module.group)
        elif isinstance(module, tpl.RowParallelLinear):
            shards[f"{prefix}.weight"] = (1, module.group)
    return shards


def _set_param(lm: torch.nn.Module, name: str, value: torch.Tensor, tensor_parallel: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    module = lm.get_submodule(owner)
    param = torch.nn.Parameter(value, requires_grad=getattr(module, leaf).requires_grad)
    if tensor_parallel:
        param.tensor_model_parallel = True  # type: ignore[attr-defined]
    setattr(module, leaf, param)


def meta_causal_lm(weights: str, layout: str) -> Any:
    """The checkpoint's LlamaForCausalLM on the meta device (no memory, no random initialisation), for a
    `layout` that fills it slice by slice; its rotary tables real (they hold no parameters). A tied
    embedding is refused: the split layouts cannot tie across ranks or stages."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from service.train.model import ATTN_IMPLEMENTATION

    config = AutoConfig.from_pretrained(weights)
    config.use_cache = False
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"{weights}: {layout} fine-tuning of tied embeddings is not supported")
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    lm.config.use_cache = False
    lm.model.rotary_emb = type(lm.model.rotary_emb)(config=lm.config)
    return lm


def load_tensor_parallel(
    weights: str, group: Any, sequence_parallel: bool, dtype: torch.dtype
) -> torch.nn.Module:
    """The checkpoint as the service's tensor-parallel LlamaForCausalLM (`apply_tensor_parallel` over
    `group`), each rank holding only its slices, read lazily from the safetensors file(s).

    The model is made on the meta device from the checkpoint's config (no random initialisation, no
    whole matrices); the parameters every rank holds whole (embedding, norms, any row-parallel bias)
    are read before `apply_tensor_parallel`, so that the sequence-parallel gradient hooks it registers
    on them hold; the sharded ones (marked `tensor_model_parallel`, as the TP layers mark theirs) after."""
    import torch.distributed as dist

    from service.train.tensor_parallel import apply_tensor_parallel

    lm = meta_causal_lm(weights, "tensor-parallel")
    reader = CheckpointReader(weights)
    rank, parts = dist.get_rank(group=group), dist.get_world_size(group=group)
    sharded = {"lm_head.weight", "lm_head.bias"}  # what apply_tensor_parallel will split
    for i in range(len(lm.model.layers)):
        column = [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")] + ["mlp.gate_proj", "mlp.up_proj"]
        sharded |= {f"model.layers.{i}.{m}.{p}" for m in column for p in ("weight", "bias")}
        sharded |= {f"model.layers.{i}.{m}.weight" for m in ("self_attn.o_proj", "mlp.down_proj")}
    for name, _ in list(lm.named_parameters()):
        if name not in sharded:
            _set_param(lm, name, reader.read(name, dtype), tensor_parallel=False)
    apply_tensor_parallel(lm, group, sequence_parallel)
    shards = tensor_parallel_shards(lm)
    if not set(shards) <= sharded:
        raise RuntimeError(f"unexpected tensor-parallel parameters: {sorted(set(shards) - sharded)}")
    for name, (dim, _) in shards.items():
        _set_param(lm, name, reader.read(name, dtype, dim, rank, parts), tensor_parallel=True)
    left = [n for n, t in (*lm.named_parameters(), *lm.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{weights}: not loaded into the tensor-parallel model: {', '.join(left)}")
    return lm


def tensor_parallel_state_dict(lm: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The full parameters of a tensor-parallel model on rank 0 (CPU copies, the checkpoint's names),
    each sharded one all-gathered over its TP group along its split dimension; other ranks return {}
    (every rank must call it: each gather is a collective of its TP group)."""
    import torch.distributed as dist

    shards = tensor_parallel_shards(lm)
    state: dict[str, torch.Tensor] = {}
    for name, param in lm.named_parameters():
        value = param.detach()
        if name in shards:
            dim, group = shards[name]
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group=group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts, dim=dim)
        if rank == 0:
            state[name] = value.to("cpu", copy=True)
    if rank == 0:
        state.update(_persistent_buffers(lm))
    return state


def probe_logits(module: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of `module` on `input_ids` (every rank must call it under ZeRO-3)."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module(input_ids=input_ids, use_cache=False)
    finally:
        module.train(was_training)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    cp_group = getattr(module, "cp_group", None)
    if cp_group is not None:  # each context-parallel rank holds its chunk of the sequence
        import torch.distributed as dist

        chunks = [torch.empty_like(logits) for _ in range(dist.get_world_size(group=cp_group))]
        dist.all_gather(chunks, logits.contiguous(), group=cp_group)
        logits = torch.cat(chunks, dim=1)
    return logits.float().cpu()


def export_hf(engine: Any, finetune: FineTune, rank: int, probe: torch.Tensor | None = None) -> None:
    """Writes the trained weights and the checkpoint's tokenizer to `finetune.export_dir` (rank 0),
    complete or not at all; with `probe` (token ids), also the trained model's logits on it next to it."""
    import torch.distributed as dist

    module = engine.module
    lm = getattr(module, "hf_model", None)  # the TP / CP stack's or the pipeline's LlamaForCausalLM
    if lm is not None and getattr(engine, "is_pipe_parallel", False):
        from service.train.weights_pp import pipeline_logits, pipeline_state_dict

        logits = pipeline_logits(engine, probe) if probe is not None else None
        state = pipeline_state_dict(module, rank)
    else:
        logits = probe_logits(module, probe.to(engine.device)) if probe is not None else None
        if lm is not None and tensor_parallel_shards(lm):
            state = tensor_parallel_state_dict(lm, rank)
        elif lm is not None:  # the context-parallel stack's model: whole on every rank, or ZeRO-3 shards
            state = gathered_state_dict(lm, rank)
        else:
            lm, state = module, gathered_state_dict(module, rank)
    if rank == 0:
        from transformers import AutoTokenizer

        out = Path(finetune.export_dir)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        lm.save_pretrained(str(partial), state_dict=state)
        AutoTokenizer.from_pretrained(finetune.weights).save_pretrained(str(partial))
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        if logits is not None and probe is not None:
            torch.save({"input_ids": probe.cpu(), "logits": logits}, out.parent / PROBE_FILE)
    dist.barrier()
