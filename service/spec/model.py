"""`ModelSpec`: the shape of a decoder-only transformer, enough to count its parameters and FLOPs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# More blocks than any model built; transformers builds per-layer lists from the count (hf_config.py).
MAX_LAYERS = 10_000


class ModelSpec(BaseModel):
    """A Llama/GPT-style decoder-only transformer.

    Linear layers carry no bias (Llama) unless `linear_biases`; `swiglu` MLPs have three matrices (gate,
    up, down), `gelu` MLPs two. Normalisation layers are RMSNorm with one weight vector of `hidden_size`
    (LayerNorm with a weight and a bias when `linear_biases`: GPT-2/3, Megatron's GPT). Bias elements
    (~0.02 % of a block) are not counted in `num_params`; they matter as tensors, to engines that
    communicate one tensor at a time (`parameter_tensors_per_block`).

    Example:
        >>> ModelSpec(num_layers=40, hidden_size=5120, num_attention_heads=40,
        ...           ffn_hidden_size=13824, vocab_size=32000).num_params / 1e9  # doctest: +ELLIPSIS
        13.01...
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("custom", description="Catalog name, for reports.")
    num_layers: int = Field(gt=0, le=MAX_LAYERS, description="Transformer blocks.")
    hidden_size: int = Field(gt=0, description="Model width h (elements).")
    num_attention_heads: int = Field(gt=0, description="Query heads a.")
    num_key_value_heads: int | None = Field(
        None, gt=0, description="Key/value heads (grouped-query attention); defaults to num_attention_heads."
    )
    ffn_hidden_size: int = Field(gt=0, description="MLP inner width f (elements).")
    vocab_size: int = Field(gt=0, description="Vocabulary size V (tokens).")
    mlp: Literal["swiglu", "gelu"] = Field("swiglu", description="MLP kind: swiglu (3 matrices) or gelu (2).")
    tie_word_embeddings: bool = Field(False, description="Output projection shares the embedding matrix.")
    linear_biases: bool = Field(
        False,
        description="Linear layers and LayerNorms carry bias vectors (GPT-2/3, Megatron's GPT); false = "
        "Llama style, no biases and RMSNorm.",
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.kv_heads}"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def weight_matrices_per_block(self) -> int:
        """Weight matrices of one block as the engines hold them: Llama style (swiglu) q, k, v, o, gate,
        up, down (Hugging Face modules); GPT style (gelu) fused QKV, attention output, MLP in and out
        (Megatron's GPT)."""
        return 7 if self.mlp == "swiglu" else 4

    @property
    def parameter_tensors_per_block(self) -> int:
        """Parameter tensors of one block: its weight matrices and two norm weights, and a bias beside
        each when `linear_biases` (Megatron's GPT block: 6 × (weight, bias) = 12)."""
        return (self.weight_matrices_per_block + 2) * (2 if self.linear_biases else 1)

    @property
    def attention_params_per_layer(self) -> int:
        """Q and O are h×h; K and V are h×(kv_heads·head_dim) each."""
        h, kv = self.hidden_size, self.kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv

    @property
    def mlp_params_per_layer(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.ffn_hidden_size

    @property
    def params_per_layer(self) -> int:
        """Attention + MLP matrices + two RMSNorm weight vectors."""
        return self.attention_params_per_layer + self.mlp_params_per_layer + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding, plus the output projection unless tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_params(self) -> int:
        """All parameters: layers, embeddings and the final norm."""
        return self.num_layers * self.params_per_layer + self.embedding_params + self.hidden_size

    def scaled(self, num_layers: int | None = None, hidden_scale: int = 1) -> ModelSpec:
        """A proxy of this model: fewer layers, and widths divided by `hidden_scale` (heads kept)."""
        changes: dict[str, object] = {"name": f"{self.name}-proxy"}
        if num_layers is not None:
            changes["num_layers"] = num_layers
        if hidden_scale != 1:
            changes["hidden_size"] = self.hidden_size // hidden_scale
            changes["ffn_hidden_size"] = self.ffn_hidden_size // hidden_scale
        return ModelSpec.model_validate({**self.model_dump(), **changes})
