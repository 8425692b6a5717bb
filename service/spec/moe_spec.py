"""`MoESpec`: the mixture-of-experts layers of a transformer (which blocks route, to how many of how
many experts, how wide, and the router's regime); `ModelSpec.moe` holds one."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.spec.errors import SpecError

# As many experts per block as any model built (PEER, He 2024, "Mixture of A Million Experts": 1024²); the
# planner tries every divisor of the count as an expert-parallel degree (plans/enumerate.py).
MAX_EXPERTS = 1 << 20

Router = Literal["dropless", "capacity"]


class MoESpec(BaseModel):
    """The mixture-of-experts layers of a transformer: which blocks route their tokens to experts, how
    many experts each token visits, and how wide they are.

    A MoE block replaces the dense MLP with `num_experts` routed expert MLPs (each of `mlp`'s kind and
    `expert_ffn_hidden_size` wide), a linear router (h × num_experts, no bias: Mixtral, Qwen-MoE,
    DeepSeek) that picks `experts_per_token` of them per token (Shazeer et al. 2017; Fedus et al. 2021,
    Switch Transformer, §2.1), and `num_shared_experts` MLPs every token passes through (DeepSeekMoE, Dai
    et al. 2024, §3.2; Qwen2-MoE). Block i (0-based) is a MoE block when i ≥ `first_dense_layers` and
    (i + 1) is a multiple of `layer_frequency` (Qwen2-MoE's `decoder_sparse_step`, DeepSeek's
    `first_k_dense_replace`); the others keep the dense MLP of `ffn_hidden_size`.

    Router regimes: `dropless` (every token reaches its experts, whatever their load: MegaBlocks, Gale
    et al. 2022; Megatron-Core's default), or `capacity` (each expert takes at most capacity_factor ×
    tokens·k / experts tokens and drops the rest; GShard, Lepikhin et al. 2020, §2.2).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_experts: int = Field(ge=2, le=MAX_EXPERTS, description="Routed experts per MoE block.")
    experts_per_token: int = Field(ge=1, description="Routed experts each token visits (top-k).")
    expert_ffn_hidden_size: int = Field(gt=0, description="Inner width of one routed expert's MLP.")
    num_shared_experts: int = Field(0, ge=0, description="Experts every token passes through.")
    shared_expert_ffn_hidden_size: int | None = Field(
        None, gt=0, description="Inner width of one shared expert (default: expert_ffn_hidden_size)."
    )
    layer_frequency: int = Field(1, gt=0, description="Every n-th block is a MoE block (1 = all).")
    first_dense_layers: int = Field(0, ge=0, description="Leading blocks that keep the dense MLP.")
    router: Router = Field("dropless", description="dropless, or capacity (token dropping).")
    capacity_factor: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Expert capacity over the balanced share of tokens (router capacity only, ≥ 1).",
    )
    expert_groups: int = Field(
        1,
        ge=1,
        description="Group-limited routing (DeepSeek-V2/V3's n_group): the experts fall into this many "
        "groups of consecutive experts; 1 = no groups.",
    )
    groups_per_token: int | None = Field(
        None,
        ge=1,
        description="Groups a token's experts may come from (DeepSeek's topk_group; V3's node-limited "
        "routing, arXiv 2412.19437 §2.1.2); default: all of them.",
    )

    @model_validator(mode="after")
    def _check_router(self) -> MoESpec:
        if self.experts_per_token > self.num_experts:
            k, e = self.experts_per_token, self.num_experts
            raise SpecError("experts_per_token", f"{k} exceeds num_experts {e}")
        if self.num_experts % self.expert_groups:
            e, g = self.num_experts, self.expert_groups
            raise SpecError(
                "expert_groups", f"{g} does not divide num_experts {e}; allowed: a divisor of {e}"
            )
        if self.groups_per_token is not None and self.groups_per_token > self.expert_groups:
            g, t = self.expert_groups, self.groups_per_token
            raise SpecError("groups_per_token", f"{t} exceeds expert_groups {g}; allowed: 1 to {g}")
        reachable = (self.groups_per_token or self.expert_groups) * (self.num_experts // self.expert_groups)
        if self.experts_per_token > reachable:
            k, groups = self.experts_per_token, self.groups_per_token or self.expert_groups
            message = f"{k} exceeds the {reachable} experts of the {groups} group(s) a token may use"
            raise SpecError("experts_per_token", f"{message}; allowed: 1 to {reachable}")
        if self.router == "capacity":
            if self.capacity_factor is None:
                raise SpecError("capacity_factor", "router 'capacity' needs a capacity factor (≥ 1)")
            if not self.capacity_factor >= 1.0:
                message = f"{self.capacity_factor} is below 1: experts would drop tokens even when balanced"
                raise SpecError("capacity_factor", message)
            if self.capacity_factor > self.num_experts:
                message = f"{self.capacity_factor} pads every expert beyond all of a batch's tokens"
                raise SpecError("capacity_factor", f"{message}; allowed: 1 to {self.num_experts}")
        elif self.capacity_factor is not None:
            raise SpecError("capacity_factor", "only router 'capacity' drops tokens; 'dropless' has none")
        return self

    @property
    def shared_width(self) -> int:
        return self.shared_expert_ffn_hidden_size or self.expert_ffn_hidden_size

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.first_dense_layers and (index + 1) % self.layer_frequency == 0

    def num_moe_layers(self, num_layers: int) -> int:
        """Blocks i < num_layers with i ≥ first_dense_layers and (i + 1) a multiple of layer_frequency."""
        f = self.layer_frequency
        return max(0, num_layers // f - min(self.first_dense_layers, num_layers) // f)
