"""The attention of a block as weight matrices: `Projection` (one matrix and how tensor parallelism splits
it) and `MLASpec`, DeepSeek's multi-head latent attention. `ModelSpec.attention_projections` lists a
block's projections; the parameter counts and the cost model's attention GEMMs read them."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

# How Megatron-style tensor parallelism holds a matrix (Shoeybi et al. 2019, §3): split along its output
# features (column), along its input features (row), or whole on every rank (none).
Split = Literal["column", "row", "none"]


class Projection(NamedTuple):
    """One weight matrix of a block's attention, `in_features` → `out_features` (a Hugging Face
    `nn.Linear` of that name)."""

    name: str
    in_features: int
    out_features: int
    split: Split

    @property
    def elements(self) -> int:
        return self.in_features * self.out_features


class MLASpec(BaseModel):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, §2.1; transformers'
    `DeepseekV3Attention`): queries and keys/values pass through low-rank latents.

    Per block: q_a_proj h × q_lora_rank, its RMSNorm (q_lora_rank), q_b_proj q_lora_rank ×
    heads·(nope + rope) (or one q_proj h × heads·(nope + rope) when `q_lora_rank` is None, DeepSeek-V2-Lite);
    kv_a_proj_with_mqa h × (kv_lora_rank + rope) with an RMSNorm on its kv_lora_rank part; kv_b_proj
    kv_lora_rank × heads·(nope + v); o_proj heads·v × h. Training runs the expanded form: every head has a
    key of nope + rope (the rope part shared by all heads) and a value of v elements.

    Under tensor parallelism q_b, kv_b (column) and o (row) are split and the down-projections q_a and
    kv_a stay whole on every rank (transformers' `base_model_tp_plan` for deepseek_v3 leaves q_a_proj out
    and replicates kv_a_proj_with_mqa; Megatron-Core's MLA builds both down-projections duplicated).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int | None = Field(
        description="Width of the query latent; None = a full-rank q_proj (DeepSeek-V2-Lite).", gt=0
    )
    kv_lora_rank: int = Field(gt=0, description="Width of the key/value latent (the compressed KV cache).")
    qk_nope_head_dim: int = Field(gt=0, description="Per-head query/key width without rotary embedding.")
    qk_rope_head_dim: int = Field(gt=0, description="Per-head query/key width with rotary embedding.")
    v_head_dim: int = Field(gt=0, description="Per-head value width.")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_norm_width(self) -> int:
        """Elements of the two latent RMSNorm weights (q_a_layernorm, kv_a_layernorm)."""
        return (self.q_lora_rank or 0) + self.kv_lora_rank

    def projections(self, hidden_size: int, heads: int) -> tuple[Projection, ...]:
        """The block's attention matrices in the order forward runs them."""
        h, q = hidden_size, heads * self.qk_head_dim
        if self.q_lora_rank is None:
            query: tuple[Projection, ...] = (Projection("q_proj", h, q, "column"),)
        else:
            query = (
                Projection("q_a_proj", h, self.q_lora_rank, "none"),
                Projection("q_b_proj", self.q_lora_rank, q, "column"),
            )
        kv_b = heads * (self.qk_nope_head_dim + self.v_head_dim)
        return (
            *query,
            Projection("kv_a_proj_with_mqa", h, self.kv_lora_rank + self.qk_rope_head_dim, "none"),
            Projection("kv_b_proj", self.kv_lora_rank, kv_b, "column"),
            Projection("o_proj", heads * self.v_head_dim, h, "row"),
        )

    def scaled(self, hidden_scale: int) -> MLASpec:
        """Every width divided by `hidden_scale` (a proxy's); the rotary width stays even."""

        def cut(width: int) -> int:
            return max(1, width // hidden_scale)

        return MLASpec(
            q_lora_rank=None if self.q_lora_rank is None else cut(self.q_lora_rank),
            kv_lora_rank=cut(self.kv_lora_rank),
            qk_nope_head_dim=cut(self.qk_nope_head_dim),
            qk_rope_head_dim=max(2, self.qk_rope_head_dim // hidden_scale // 2 * 2),
            v_head_dim=cut(self.v_head_dim),
        )
