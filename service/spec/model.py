"""`ModelSpec`: the shape of a decoder-only transformer, enough to count its parameters and FLOPs."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from service.spec.attention import MLASpec, Projection
from service.spec.errors import SpecError
from service.spec.moe_spec import MoESpec

# More blocks than any model built; transformers builds per-layer lists from the count (hf_config.py).
MAX_LAYERS = 10_000


class ModelSpec(BaseModel):
    """A Llama/GPT-style decoder-only transformer.

    Linear layers carry no bias (Llama) unless `linear_biases`; `swiglu` MLPs have three matrices (gate,
    up, down), `gelu` MLPs two. Attention is q, k, v, o with heads of `head_dim` (hidden_size /
    num_attention_heads unless given: Qwen3, Gemma), or multi-head latent attention (`mla`, DeepSeek).
    Normalisation layers are RMSNorm with one weight vector of `hidden_size` (LayerNorm with a weight and
    a bias when `linear_biases`: GPT-2/3, Megatron's GPT). Bias elements (~0.02 % of a block) are not
    counted in `num_params`; they matter as tensors, to engines that communicate one tensor at a time
    (`parameter_tensors_per_block`).

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
    moe: MoESpec | None = Field(None, description="Mixture-of-experts blocks; None = a dense model.")
    head_dim: int = Field(
        0,
        ge=0,
        description="Query/key/value width of one head; 0 or left out: hidden_size / num_attention_heads "
        "(mla: qk_nope_head_dim + qk_rope_head_dim).",
    )
    mla: MLASpec | None = Field(
        None, description="Multi-head latent attention (DeepSeek-V2/V3); None = q, k, v and o projections."
    )

    @model_validator(mode="after")
    def _check_heads(self) -> ModelSpec:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        self._check_head_dim()
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.moe is not None and self.moe.num_moe_layers(self.num_layers) == 0:
            first, every = self.moe.first_dense_layers, self.moe.layer_frequency
            message = (
                f"no MoE block among {self.num_layers} layers (first_dense_layers {first}, every {every})"
            )
            raise SpecError("moe.first_dense_layers", message)
        return self

    def _check_head_dim(self) -> None:
        """Fills `head_dim` when left out; refuses what the attention cannot be."""
        derived = self._derived_head_dim()
        if self.mla is not None:
            if self.head_dim and self.head_dim != derived:
                message = f"{self.head_dim} with mla: its query/key head width is nope + rope = {derived}"
                raise SpecError("head_dim", message)
            if self.kv_heads != self.num_attention_heads:
                message = f"{self.kv_heads} with mla: latent attention expands keys and values to every head"
                raise SpecError("num_key_value_heads", message)
        elif not self.head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if not self.head_dim:
            object.__setattr__(self, "head_dim", derived)

    def _derived_head_dim(self) -> int:
        return self.mla.qk_head_dim if self.mla is not None else self.hidden_size // self.num_attention_heads

    @model_serializer(mode="wrap")
    def _canonical(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A dump leaves out what is implied: `moe` and `mla` when None, `head_dim` when it is
        hidden_size / num_attention_heads (or MLA's), so that `{**dump, "hidden_size": ...}` derives it
        again instead of carrying the old width over."""
        data = handler(self)
        if isinstance(data, dict):
            for key in ("moe", "mla"):
                if key in data and data[key] is None:
                    del data[key]
            if data.get("head_dim") == self._derived_head_dim():
                del data["head_dim"]
        return data

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def v_head_dim(self) -> int:
        """Value width of one head (MLA's v_head_dim; else `head_dim`)."""
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def q_width(self) -> int:
        """Query features of a token: heads × query/key head width (hidden_size unless `head_dim` or
        `mla` says otherwise)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key plus value features of a token: kv_heads × (key width + value width)."""
        return self.kv_heads * (self.head_dim + self.v_head_dim)

    @property
    def attention_out_width(self) -> int:
        """Features of the attention's output, the input of o_proj: heads × value width."""
        return self.num_attention_heads * self.v_head_dim

    @property
    def rotary_width(self) -> int:
        """Features rotary embedding turns per token: all of q and k, or MLA's rope part of each head's
        query and the one rope key every head shares."""
        if self.mla is not None:
            return (self.num_attention_heads + 1) * self.mla.qk_rope_head_dim
        return self.q_width + self.kv_heads * self.head_dim

    @property
    def latent_norm_width(self) -> int:
        """Elements of MLA's latent RMSNorm weights (0 without MLA)."""
        return 0 if self.mla is None else self.mla.latent_norm_width

    @property
    def attention_projections(self) -> tuple[Projection, ...]:
        """One block's attention matrices in the order forward runs them: q, k, v (column-parallel),
        o (row-parallel); or MLA's (see `MLASpec`)."""
        if self.mla is not None:
            return self.mla.projections(self.hidden_size, self.num_attention_heads)
        h, k = self.hidden_size, self.kv_heads * self.head_dim
        return (
            Projection("q_proj", h, self.q_width, "column"),
            Projection("k_proj", h, k, "column"),
            Projection("v_proj", h, self.kv_heads * self.v_head_dim, "column"),
            Projection("o_proj", self.attention_out_width, h, "row"),
        )

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    @property
    def weight_matrices_per_block(self) -> int:
        """Weight matrices of one block as the engines hold them: Llama style (swiglu) q, k, v, o, gate,
        up, down (Hugging Face modules); GPT style (gelu) fused QKV, attention output, MLP in and out
        (Megatron's GPT); MLA's projections and the MLP's."""
        if self.mla is not None:
            return len(self.attention_projections) + self.mlp_matrices
        return 7 if self.mlp == "swiglu" else 4

    @property
    def parameter_tensors_per_block(self) -> int:
        """Parameter tensors of one block: its weight matrices and norm weights (two, and MLA's latent
        norms), and a bias beside each when `linear_biases` (Megatron's GPT block: 6 × (weight, bias) =
        12)."""
        latent_norms = 0 if self.mla is None else (1 if self.mla.q_lora_rank is None else 2)
        return (self.weight_matrices_per_block + 2 + latent_norms) * (2 if self.linear_biases else 1)

    @property
    def attention_params_per_layer(self) -> int:
        """The attention's weight matrices (`attention_projections`): q and o h × heads·head_dim, k and
        v h × kv_heads·head_dim (2h² + 2h·kv when head_dim = h / heads); or MLA's (`MLASpec`), whose latent
        norms are in `norm_params_per_layer`."""
        return sum(p.elements for p in self.attention_projections)

    @property
    def attention_replicated_params_per_layer(self) -> int:
        """Attention matrices tensor parallelism keeps whole on every rank (MLA's down-projections)."""
        return sum(p.elements for p in self.attention_projections if p.split == "none")

    @property
    def norm_params_per_layer(self) -> int:
        """RMSNorm weights of one block: before attention and before the MLP (h each), and MLA's latent
        norms."""
        return 2 * self.hidden_size + self.latent_norm_width

    @property
    def mlp_params_per_layer(self) -> int:
        return self.mlp_matrices * self.hidden_size * self.ffn_hidden_size

    @property
    def params_per_layer(self) -> int:
        """Attention + MLP matrices + the block's RMSNorm weights."""
        return self.attention_params_per_layer + self.mlp_params_per_layer + self.norm_params_per_layer

    @property
    def embedding_params(self) -> int:
        """Input embedding, plus the output projection unless tied."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else self.moe.num_moe_layers(self.num_layers)

    @property
    def expert_params_per_moe_layer(self) -> int:
        """The routed experts of one MoE block (each an MLP of `mlp`'s kind)."""
        if self.moe is None:
            return 0
        return self.moe.num_experts * self.mlp_matrices * self.hidden_size * self.moe.expert_ffn_hidden_size

    @property
    def shared_params_per_moe_layer(self) -> int:
        """What every token of a MoE block passes through besides attention: the shared experts and the
        router's h × num_experts matrix."""
        if self.moe is None:
            return 0
        m, h = self.moe, self.hidden_size
        return m.num_shared_experts * self.mlp_matrices * h * m.shared_width + h * m.num_experts

    @property
    def expert_params(self) -> int:
        """All routed-expert parameters (what expert parallelism shards)."""
        return self.num_moe_layers * self.expert_params_per_moe_layer

    @property
    def num_params(self) -> int:
        """All parameters: layers, embeddings and the final norm (every routed expert counted)."""
        dense_layers = self.num_layers - self.num_moe_layers
        blocks = self.num_layers * (self.attention_params_per_layer + self.norm_params_per_layer)
        blocks += dense_layers * self.mlp_params_per_layer
        blocks += self.num_moe_layers * (self.shared_params_per_moe_layer + self.expert_params_per_moe_layer)
        return blocks + self.embedding_params + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: every routed expert but its top-k left out. The input
        embedding is counted, as Mistral AI, Qwen and AI2 count it (Mixtral 8x7B's 12.9B); DeepSeek
        leaves it out (DeepSeek-V3's 37B: 36.6B with the output head, README_WEIGHTS.md)."""
        if self.moe is None:
            return self.num_params
        idle = self.moe.num_experts - self.moe.experts_per_token
        per_expert = self.expert_params_per_moe_layer // self.moe.num_experts
        return self.num_params - self.num_moe_layers * idle * per_expert

    def dense_view(self) -> ModelSpec:
        """This model with its routed experts taken out: what the dense cost terms price.

        Every block keeps its attention and norms; its MLP becomes the mean over blocks of what every
        token passes through outside the routed experts (the dense blocks' MLP, the MoE blocks' shared
        experts and router), so the view holds `num_params − expert_params` parameters (to rounding of
        the width) and its MLP matmul FLOPs per token are the model's outside the routed experts. The
        routed experts are priced by service/costmodel/moe.py. A dense model is its own view.
        """
        if self.moe is None:
            return self
        dense_layers = self.num_layers - self.num_moe_layers
        outside = (
            dense_layers * self.mlp_params_per_layer + self.num_moe_layers * self.shared_params_per_moe_layer
        )
        width = max(1, round(outside / (self.num_layers * self.mlp_matrices * self.hidden_size)))
        return self.model_copy(update={"moe": None, "ffn_hidden_size": width})

    def scaled(self, num_layers: int | None = None, hidden_scale: int = 1) -> ModelSpec:
        """A proxy of this model: fewer layers, and widths divided by `hidden_scale` (heads kept)."""
        changes: dict[str, object] = {"name": f"{self.name}-proxy"}
        if num_layers is not None:
            changes["num_layers"] = num_layers
        if hidden_scale != 1:
            changes["hidden_size"] = self.hidden_size // hidden_scale
            changes["ffn_hidden_size"] = self.ffn_hidden_size // hidden_scale
            if self.mla is not None:
                changes["mla"] = self.mla.scaled(hidden_scale).model_dump()
            elif self.head_dim != self._derived_head_dim():
                changes["head_dim"] = max(1, self.head_dim // hidden_scale)
            if self.moe is not None:
                moe = self.moe.model_dump()
                moe["expert_ffn_hidden_size"] = max(1, self.moe.expert_ffn_hidden_size // hidden_scale)
                if self.moe.shared_expert_ffn_hidden_size:
                    moe["shared_expert_ffn_hidden_size"] = max(1, self.moe.shared_width // hidden_scale)
                changes["moe"] = moe
        if num_layers is not None and self.moe is not None:
            # A proxy keeps at least one MoE block: its leading dense blocks shrink with it.
            scaled_moe = changes.get("moe")
            moe = dict(scaled_moe) if isinstance(scaled_moe, dict) else self.moe.model_dump()
            moe["first_dense_layers"] = min(
                self.moe.first_dense_layers, max(0, num_layers - self.moe.layer_frequency)
            )
            changes["moe"] = moe
        return ModelSpec.model_validate({**self.model_dump(), **changes})
