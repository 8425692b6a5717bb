"""A `ModelSpec` from a Hugging Face `config.json`: the model a user fine-tunes, given as the config file
(or the folder holding it) they already have, with nothing downloaded.

`transformers.AutoConfig` reads the file, so each architecture's own names resolve through its config
class's `attribute_map` (GPT-2's `n_layer`, MPT's `d_model`, ... answer to `num_hidden_layers` and
`hidden_size`). Mixture-of-experts blocks and DeepSeek's latent attention are read by hf_moe.py. What
`ModelSpec` cannot say is refused with the field named, never approximated: experts in an architecture
not listed there, a `head_dim` other than hidden_size / num_attention_heads where the architecture's
attention ignores it, an architecture whose MLP kind is not known here.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError, validate_as
from service.spec.hf_moe import MLA_TYPES, MOE_TYPES, mla_fields, moe_fields, refuse_unmodelled
from service.spec.model import MAX_LAYERS, ModelSpec  # MAX_LAYERS: a huge count would hang transformers

# MLPs with a gate: three matrices (SwiGLU; Gemma's GeGLU has the same three shapes and FLOPs); the
# experts of every MoE architecture read here are SwiGLU MLPs too.
GATED_MLP = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite", "cohere"}
    | {"stablelm", "smollm3"}
    | MOE_TYPES
)
# Two-matrix MLPs (up, activation, down; Nemotron's squared ReLU too).
PLAIN_MLP = frozenset(
    {"gpt2", "gpt_neo", "gpt_neox", "opt", "bloom", "falcon", "mpt", "gptj", "gpt_bigcode", "starcoder2"}
    | {"nemotron"}
)
# Architectures whose every linear layer and norm carries a bias (GPT-2, GPT-NeoX, BLOOM, StarCoder);
# the others say it in a config field (`_linear_biases`). GPT-Neo and GPT-J leave some out: not biased.
BIASED = frozenset({"gpt2", "gpt_neox", "bloom", "gpt_bigcode"})
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Attention that sizes its heads by the config's `head_dim` (`getattr(config, "head_dim", None)` in the
# modeling file); the others take hidden_size / num_attention_heads whatever the config says.
HEAD_DIM_READ = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2", "granite", "cohere"}
    | {"smollm3", "starcoder2", "nemotron", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}
)


def is_hf_config(path: str | Path) -> bool:
    """A `.json` file, or a folder with a `config.json` in it."""
    p = Path(path)
    return p.suffix.lower() == ".json" or (p.is_dir() and (p / "config.json").is_file())


def load_hf_config(path: str | Path) -> ModelSpec:
    """Reads a Hugging Face config (file or folder) into a `ModelSpec` named after its folder."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    from service.spec.experiment import read_text

    if not file.is_file():
        raise SpecError("model", "no such file", str(path))
    try:
        data = json.loads(read_text(file, "model", "JSON file"))
    except (json.JSONDecodeError, RecursionError) as err:
        raise SpecError("model", f"not a JSON file ({err})", str(file)) from None
    if not isinstance(data, dict):
        raise SpecError("model", "a config.json holds one JSON object", str(file))
    name = file.parent.name if file.name == "config.json" else file.stem
    return model_spec_from_hf(data, name=name or "custom", source=str(file))


def _config(data: dict[str, Any], source: str) -> Any:
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    kind = data.get("model_type")
    if not isinstance(kind, str):
        raise SpecError("model_type", "missing: a Hugging Face config.json names its model_type", source)
    if kind not in GATED_MLP | PLAIN_MLP:
        known = ", ".join(sorted(GATED_MLP | PLAIN_MLP))
        raise SpecError(
            "model_type",
            f"{kind!r}: MLP kind unknown here; known: {known}; or write a ModelSpec YAML",
            source,
        )
    fields = {k: v for k, v in data.items() if k != "model_type"}
    # transformers logs its own opinions of a config (token ids outside the vocabulary, rope settings):
    # not what the service reads, and an error must stay one line.
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.for_model(kind, **fields)
    except Exception as err:  # transformers and huggingface_hub validators raise their own types
        why = " ".join(str(getattr(err, "__cause__", None) or err).split())[:200]
        raise SpecError("config", f"transformers refuses this {kind} config: {why}", source) from None
    finally:
        hf_logging.set_verbosity(previous)


def _ffn_hidden_size(cfg: Any) -> int:
    for key in ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim"):
        value = getattr(cfg, key, None)
        if value:
            return int(value)
    ratio = getattr(cfg, "expansion_ratio", None)  # MPT
    return int(ratio * cfg.hidden_size) if ratio else 4 * int(cfg.hidden_size)


def _kv_heads(cfg: Any) -> int | None:
    for key in ("num_key_value_heads", "num_kv_heads"):
        value = getattr(cfg, key, None)
        if value:
            return int(value)
    if getattr(cfg, "multi_query", False):
        return 1
    attn = getattr(cfg, "attn_config", None)  # MPT
    value = attn.get("kv_n_heads") if isinstance(attn, dict) else getattr(attn, "kv_n_heads", None)
    return int(value) if value else None


def _linear_biases(cfg: Any) -> bool:
    """Whether every linear layer carries a bias (`ModelSpec.linear_biases`), from the config's own
    switch where the architecture has one (OPT `enable_bias`, MPT `no_bias`, Falcon `bias`, StarCoder2
    `use_bias`, Llama-family `attention_bias` and `mlp_bias`, both off by default)."""
    kind = cfg.model_type
    if kind in BIASED:
        return True
    switches = {"opt": ("enable_bias", True), "falcon": ("bias", False), "starcoder2": ("use_bias", True)}
    if kind in switches:
        key, default = switches[kind]
        return bool(getattr(cfg, key, default))
    if kind == "mpt":
        return not bool(getattr(cfg, "no_bias", True))
    return bool(getattr(cfg, "attention_bias", False)) and bool(getattr(cfg, "mlp_bias", False))


def model_spec_from_hf(data: dict[str, Any], name: str = "custom", source: str | None = None) -> ModelSpec:
    """`ModelSpec` fields from a config.json's dict (see the module docstring for what is refused).

    Example:
        >>> spec = model_spec_from_hf({"model_type": "llama", "num_hidden_layers": 40, "hidden_size": 5120,
        ...     "num_attention_heads": 40, "intermediate_size": 13824, "vocab_size": 32000}, "llama-2-13b")
        >>> spec.mlp, spec.kv_heads, round(spec.num_params / 1e9, 2)
        ('swiglu', 40, 13.02)
    """
    where = source or name
    if not isinstance(data.get("model_type"), str):
        raise SpecError("model_type", "missing: a Hugging Face config.json names its model_type", where)
    _check_field_types(data, where)
    if isinstance(data.get("text_config"), dict):
        raise SpecError(
            "text_config",
            f"a multimodal {data.get('model_type')} config: its vision or audio encoder is not modelled; "
            "save the language model's text_config (with its model_type) as a config.json of its own",
            where,
        )
    for key in EXPERT_KEYS:
        experts, kind = data.get(key), data.get("model_type")
        if kind not in MOE_TYPES and isinstance(experts, int) and experts > 1:
            known = ", ".join(sorted(MOE_TYPES))
            message = f"{experts} experts in a {kind} config; MoE architectures read: {known}"
            raise SpecError(key, message, where)
    for key in ("num_hidden_layers", "n_layer", "n_layers", "num_layers"):
        layers = data.get(key)
        if isinstance(layers, int) and not 0 < layers <= MAX_LAYERS:
            raise SpecError(key, f"{layers} layers: expected 1 to {MAX_LAYERS:,}", where)
    if data.get("num_key_value_heads") == 0:
        raise SpecError("num_key_value_heads", "0: a model needs at least one key/value head", where)
    cfg = _config(data, where)
    try:
        return validate_as(ModelSpec, _fields(cfg, name, where), where)
    except (TypeError, ValueError, OverflowError) as err:
        if isinstance(err, SpecError):
            raise
        why = " ".join(str(err).split())[:200]
        raise SpecError("config", f"a field has the wrong type or value: {why}", where) from None


# The config keys that size the model (every architecture's spelling): whole numbers where present.
WHOLE_NUMBER_KEYS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "hidden_size", "n_embd", "d_model",
    "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "intermediate_size", "n_inner",
    "ffn_hidden_size", "vocab_size", "head_dim", "num_experts", "num_local_experts", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
)  # fmt: skip
# torch's dtype names (torch.<name> is a dtype), as transformers resolves a config's torch_dtype.
TORCH_DTYPES = (
    "auto", "float32", "float", "float64", "double", "float16", "half", "bfloat16", "float8_e4m3fn",
    "float8_e5m2", "int8", "uint8", "int16", "int32", "int64", "bool",
)  # fmt: skip


def _check_field_types(data: dict[str, Any], where: str) -> None:
    """One line naming the key for a sizing value that is not a whole number, or a torch_dtype torch does
    not have (transformers' own errors name neither)."""
    for key in WHOLE_NUMBER_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(key, f"{value!r}: a whole number", where)
    dtype = data.get("torch_dtype", data.get("dtype"))
    if dtype is not None and dtype not in TORCH_DTYPES:
        raise SpecError(
            "torch_dtype", f"{dtype!r}: not a torch dtype; known: {', '.join(TORCH_DTYPES)}", where
        )


def _fields(cfg: Any, name: str, where: str) -> dict[str, Any]:
    """ModelSpec's fields from a transformers config object."""
    kind = cfg.model_type
    mlp = "swiglu" if kind in GATED_MLP else "gelu"
    hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    if kind in MOE_TYPES:
        refuse_unmodelled(cfg, where)
    attention = _attention_fields(cfg, hidden, heads, where)
    projection = getattr(cfg, "word_embed_proj_dim", None)  # OPT-350m: embeddings narrower than the blocks
    if projection and int(projection) != hidden:
        raise SpecError(
            "word_embed_proj_dim",
            f"{projection} ≠ hidden_size {hidden}: projected embeddings are not modelled",
            where,
        )
    return {
        "name": name,
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(cfg),
        "ffn_hidden_size": _ffn_hidden_size(cfg),
        "vocab_size": cfg.vocab_size,
        "mlp": mlp,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "linear_biases": _linear_biases(cfg),
        **attention,
        **({"moe": moe_fields(cfg, where)} if kind in MOE_TYPES else {}),
    }


def _attention_fields(cfg: Any, hidden: int, heads: int, where: str) -> dict[str, Any]:
    """`mla` for DeepSeek's latent attention (whose config `head_dim` is the rotary width), `head_dim`
    where the architecture sizes its heads by it; refused where it does not and it differs."""
    kind = cfg.model_type
    if kind in MLA_TYPES:
        return {"mla": mla_fields(cfg, where)}
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None and (
        isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0
    ):
        raise SpecError("head_dim", f"{head_dim!r}: a positive whole width per head, or left out", where)
    if not head_dim or not heads or int(head_dim) * heads == hidden:
        return {}
    if kind in HEAD_DIM_READ:
        return {"head_dim": head_dim}
    raise SpecError(
        "head_dim",
        f"{head_dim} × {heads} heads ≠ hidden_size {hidden}: {kind}'s attention takes hidden_size / "
        "num_attention_heads",
        where,
    )
