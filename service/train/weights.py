"""Fine-tuning the user's own weights: a local Hugging Face checkpoint folder in, the trained weights out.

- `check_layout` / `check_checkpoint`: refused in one line before anything starts (a tensor- or
  pipeline-parallel plan; a missing folder, config.json, weights file or tokenizer; a config that does
  not match the experiment's model; a sequence length beyond the checkpoint's positions).
- `load_causal_lm` (on every worker): `AutoModelForCausalLM.from_pretrained` for the plan's layout. Under
  ZeRO-3 it goes through DeepSpeed's own path for Hugging Face models: a `HfDeepSpeedConfig` (or, where
  `accelerate` is absent, an object with the same two methods transformers reads) is registered and kept
  alive, so `from_pretrained` builds the model inside `deepspeed.zero.Init` (every parameter partitioned
  as it is made) and copies the checkpoint in one module at a time from rank 0; no rank holds the whole
  model. ZeRO 0-2 replicate the model on every rank anyway, so each rank loads it whole.
- `export_hf` (on every worker, after the last step): the trained weights gathered one parameter at a
  time onto rank 0 (`deepspeed.zero.GatheredParameters`; a no-op below ZeRO-3) in the dtype the engine
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

from service.spec.errors import SpecError
from service.spec.model import ModelSpec
from service.spec.plan import Plan

EXPORT_DIR = "hf_model"
PROBE_FILE = "hf_model_probe.pt"  # logits of the trained model on one evaluation sequence (tests compare)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# ModelSpec field → the Hugging Face config.json key that holds it.
CONFIG_FIELDS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "tie_word_embeddings": "tie_word_embeddings",
}


class FineTune(BaseModel):
    """What a worker needs to fine-tune: sent by the driver inside `WorkerConfig.finetune`."""

    model_config = ConfigDict(extra="forbid")

    weights: str  # the checkpoint folder (config.json, safetensors, tokenizer)
    data_dir: str | None = None  # packed train.npy / eval.npy (service.train.hf_data); None: proxy.data
    eval_every: int = 0  # steps between evaluations (0: at the end only); needs data_dir
    export_dir: str  # where the trained weights go (`<run_dir>/hf_model`)


def check_layout(plan: Plan) -> None:
    """Weights load into data-parallel (ZeRO 0-3) layouts only, for now."""
    if plan.tp > 1 or plan.pp > 1 or plan.cp > 1:
        raise SpecError(
            "--weights",
            f"loading weights into tensor/pipeline layouts is not supported yet (plan {plan.short()} has "
            f"tp={plan.tp}, pp={plan.pp}, cp={plan.cp}); pick a plan with tp=1, pp=1, cp=1",
        )


def read_config(weights: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json, after checking that the folder has weights and a tokenizer."""
    folder = Path(weights)
    if not folder.is_dir():
        raise SpecError("--weights", f"no such checkpoint folder: {folder}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SpecError("--weights", f"{folder} has no config.json")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise SpecError("--weights", f"{folder} has no model.safetensors (nor model.safetensors.index.json)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise SpecError("--weights", f"{folder} has no tokenizer file ({' or '.join(TOKENIZER_FILES)})")
    try:
        config: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise SpecError("--weights", f"{config_path} is not readable JSON: {err}") from None
    return config


def check_checkpoint(weights: str | Path, model: ModelSpec, seq_len: int) -> dict[str, Any]:
    """The checkpoint's config, checked against the experiment's model and sequence length."""
    config = read_config(weights)
    path = Path(weights) / "config.json"
    for field, key in CONFIG_FIELDS.items():
        mine = model.kv_heads if field == "num_key_value_heads" else getattr(model, field)
        theirs = config.get(key)
        if key == "num_key_value_heads" and theirs is None:
            theirs = config.get("num_attention_heads")  # Hugging Face's default: no grouped-query attention
        if key == "tie_word_embeddings" and theirs is None:
            theirs = False
        if theirs is None:
            raise SpecError("--weights", f"{path} has no {key}")
        if theirs != mine:
            raise SpecError(
                "--weights", f"{path}: {key} is {theirs} but the experiment's model.{field} is {mine}"
            )
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and seq_len > positions:
        raise SpecError(
            "workload.seq_len",
            f"{seq_len} is above the checkpoint's max_position_embeddings {positions} ({path})",
        )
    return config


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
        persistent = module.state_dict().keys()
        for name, buf in module.named_buffers():
            if name in persistent:
                state[name] = buf.detach().to("cpu", copy=True)
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
    return (out if isinstance(out, torch.Tensor) else out.logits).float().cpu()


def export_hf(engine: Any, finetune: FineTune, rank: int, probe: torch.Tensor | None = None) -> None:
    """Writes the trained weights and the checkpoint's tokenizer to `finetune.export_dir` (rank 0),
    complete or not at all; with `probe` (token ids), also the trained model's logits on it next to it."""
    import torch.distributed as dist

    module = engine.module
    logits = probe_logits(module, probe.to(engine.device)) if probe is not None else None
    state = gathered_state_dict(module, rank)
    if rank == 0:
        from transformers import AutoTokenizer

        out = Path(finetune.export_dir)
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        module.save_pretrained(str(partial), state_dict=state)
        AutoTokenizer.from_pretrained(finetune.weights).save_pretrained(str(partial))
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
        if logits is not None and probe is not None:
            torch.save({"input_ids": probe.cpu(), "logits": logits}, out.parent / PROBE_FILE)
    dist.barrier()
