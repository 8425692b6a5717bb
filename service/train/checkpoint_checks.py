"""What a fine-tuning run checks on the driver before anything starts, each refusal one line naming the
flag: the layout (a tied embedding under tp > 1 or pp > 1; a MoE model, whose experts the loaders
cannot place) and the checkpoint folder (config.json, a weights file and a tokenizer present; its config
matching the experiment's model; the sequence length within its positions). No torch: the loaders that
follow are service/train/weights.py and weights_pp.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError
from service.spec.model import ModelSpec
from service.spec.plan import Plan

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# A tokenizer's vocabulary: tokenizer_config.json alone names a class, and transformers then builds an
# empty tokenizer from it that turns every row into one end-of-sequence token.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

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


def check_layout(plan: Plan, model: ModelSpec | None = None) -> None:
    """Weights load into data-parallel (ZeRO 0-3), tensor-, pipeline- and context-parallel layouts; not a
    tied embedding into tensor- or pipeline-parallel ones, nor a MoE model's experts into DeepSpeed's MoE
    layers (the loaders read Llama checkpoints)."""
    if model is not None and model.moe is not None:
        raise SpecError(
            "--weights",
            "loading a mixture-of-experts checkpoint (model.moe) into the proxy's DeepSpeed MoE layers is "
            "not supported yet; the weights loaders read dense Llama checkpoints",
        )
    if model is not None and model.tie_word_embeddings and (plan.tp > 1 or plan.pp > 1):
        raise SpecError(
            "--weights",
            f"the model ties its embeddings (model.tie_word_embeddings), which the tensor-parallel layers do "
            f"not split nor the pipeline stages share (plan {plan.short()} has tp={plan.tp}, pp={plan.pp}); "
            "pick a plan with tp=1 and pp=1",
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
        raise SpecError("--weights", f"{folder} has no tokenizer vocabulary ({' or '.join(TOKENIZER_FILES)})")
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
