"""The mixture-of-experts blocks and latent attention of a Hugging Face config, as `ModelSpec`'s `moe`
and `mla` fields (hf_config.py reads the rest of the config).

Each architecture's own keys, as its transformers modeling file builds the blocks (transformers 5):
  - mixtral: `num_local_experts` experts of `intermediate_size`, top `num_experts_per_tok`, every block
    (router_jitter_noise and the aux-loss knobs change no shape);
  - olmoe: `num_experts` of `intermediate_size`, every block (its q/k RMSNorms, h + kv·head_dim
    weights per block, 0.001 % of OLMoE-1B-7B, are not counted);
  - qwen2_moe, qwen3_moe: `num_experts` of `moe_intermediate_size` in block i when (i + 1) is a multiple of
    `decoder_sparse_step` and i is not in `mlp_only_layers` (the others: dense MLPs of
    `intermediate_size`); qwen2_moe adds one shared expert of `shared_expert_intermediate_size`, whose
    sigmoid gate (an h × 1 matrix per block) is not counted; Qwen3's q/k RMSNorms (2·head_dim per block)
    are not either;
  - deepseek_v2, deepseek_v3: `n_routed_experts` of `moe_intermediate_size` from block
    `first_k_dense_replace` on, and one shared MLP `n_shared_experts` × `moe_intermediate_size` wide
    (`DeepseekV3MoE.shared_experts`); group-limited routing (topk_method, n_group, topk_group) limits
    where a token's experts are (`MoESpec.expert_groups`); the routing scale changes nothing priced.
    DeepSeek-V3's aux-loss-free bias (e_score_correction_bias, one per expert per block) is a buffer in
    transformers and not counted. Multi-head latent attention from q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim (their `head_dim` is the rotary width, not the heads').

Routers are dropless (transformers' MoE blocks drop no token), unless the config gives a
`capacity_factor`. Anything else that changes the count is refused, the field named.
"""

from __future__ import annotations

from typing import Any

from service.spec.errors import SpecError
from service.spec.moe_spec import MAX_EXPERTS

# model_type → (routed experts, experts per token, expert width) keys.
EXPERT_FIELDS = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
    "olmoe": ("num_experts", "num_experts_per_tok", "intermediate_size"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "deepseek_v2": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
}
MOE_TYPES = frozenset(EXPERT_FIELDS)
MLA_TYPES = frozenset({"deepseek_v2", "deepseek_v3"})
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _count(cfg: Any, key: str, where: str, least: int) -> int:
    """`cfg.key` as an int of at least `least`, else a one-line refusal naming the key."""
    value = getattr(cfg, key, None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(key, f"{value!r}: expected a whole number", where)
    if value < least:
        raise SpecError(key, f"{value}: expected at least {least}", where)
    return value


def moe_fields(cfg: Any, where: str) -> dict[str, Any]:
    """`MoESpec` fields of a config of one of `MOE_TYPES`."""
    kind = cfg.model_type
    experts_key, top_k_key, width_key = EXPERT_FIELDS[kind]
    experts = _count(cfg, experts_key, where, 0)
    if not 2 <= experts <= MAX_EXPERTS:
        message = f"{experts} experts: a mixture-of-experts block routes to 2 to {MAX_EXPERTS:,}"
        raise SpecError(experts_key, message, where)
    top_k = _count(cfg, top_k_key, where, 1)
    if top_k > experts:
        raise SpecError(top_k_key, f"{top_k} exceeds {experts_key} {experts}", where)
    fields: dict[str, Any] = {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_ffn_hidden_size": _count(cfg, width_key, where, 1),
        **_shared_expert(cfg, where),
        **_layer_pattern(cfg, where),
        **_expert_groups(cfg, where, experts),
    }
    capacity = getattr(cfg, "capacity_factor", None)
    if capacity is not None:
        fields |= {"router": "capacity", "capacity_factor": capacity}
    return fields


def _expert_groups(cfg: Any, where: str, experts: int) -> dict[str, Any]:
    """DeepSeek's group-limited routing: `n_group` groups of consecutive experts, a token's experts from
    its best `topk_group` of them (V2's topk_method group_limited_greedy, V3's noaux_tc; V2's greedy and
    n_group 1 route over all experts; modeling_deepseek.py `MoEGate`)."""
    if cfg.model_type not in MLA_TYPES or getattr(cfg, "topk_method", "greedy") == "greedy":
        return {}
    groups = _count(cfg, "n_group", where, 1)
    if groups == 1:
        return {}
    if experts % groups:
        raise SpecError("n_group", f"{groups} does not divide n_routed_experts {experts}", where)
    per_token = _count(cfg, "topk_group", where, 1)
    if per_token > groups:
        raise SpecError("topk_group", f"{per_token} exceeds n_group {groups}", where)
    return {"expert_groups": groups, "groups_per_token": per_token}


def _shared_expert(cfg: Any, where: str) -> dict[str, Any]:
    """One shared MLP: Qwen2-MoE's `shared_expert`, DeepSeek's `shared_experts` (one MLP of
    n_shared_experts × moe_intermediate_size, modeling_deepseek_v3.py)."""
    kind = cfg.model_type
    if kind == "qwen2_moe":
        width = getattr(cfg, "shared_expert_intermediate_size", None) or 0
    elif kind in MLA_TYPES:
        width = (getattr(cfg, "n_shared_experts", None) or 0) * _count(cfg, "moe_intermediate_size", where, 1)
    else:
        return {}
    if not isinstance(width, int) or width < 0:
        key = "shared_expert_intermediate_size" if kind == "qwen2_moe" else "n_shared_experts"
        raise SpecError(key, f"{getattr(cfg, key)!r}: expected a whole number ≥ 0", where)
    return {"num_shared_experts": 1, "shared_expert_ffn_hidden_size": width} if width else {}


def _layer_pattern(cfg: Any, where: str) -> dict[str, int]:
    """`first_dense_layers` and `layer_frequency` of the blocks the modeling file makes MoE blocks."""
    kind, layers = cfg.model_type, int(cfg.num_hidden_layers)
    if kind in MLA_TYPES:
        # DeepSeek's own modeling_deepseek.py puts experts in block i ≥ k when i % moe_layer_freq == 0,
        # transformers' in every block ≥ k: the two agree only at 1, the value of every release.
        freq = getattr(cfg, "moe_layer_freq", 1)
        if freq != 1:
            message = (
                f"{freq!r}: only 1 is modelled (DeepSeek's code and transformers disagree on the others)"
            )
            raise SpecError("moe_layer_freq", message, where)
        first = _count(cfg, "first_k_dense_replace", where, 0)
        if first >= layers:
            raise SpecError("first_k_dense_replace", f"{first}: no MoE block among {layers} layers", where)
        return {"first_dense_layers": first}
    if kind not in ("qwen2_moe", "qwen3_moe"):
        return {}
    step = _count(cfg, "decoder_sparse_step", where, 1)
    dense = getattr(cfg, "mlp_only_layers", None) or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        raise SpecError("mlp_only_layers", f"{_listed(dense)}: expected a list of block indices", where)
    dense_set = set(dense)
    moe = [i for i in range(layers) if i not in dense_set and (i + 1) % step == 0]
    if not moe:
        key = "mlp_only_layers" if dense else "decoder_sparse_step"
        value = _listed(dense) if dense else step
        raise SpecError(key, f"{value}: no MoE block among {layers} layers", where)
    first = moe[0]
    if moe != [i for i in range(first, layers) if (i + 1) % step == 0]:
        message = f"{_listed(dense)}: dense blocks other than the leading ones are not modelled"
        raise SpecError("mlp_only_layers", message, where)
    return {"first_dense_layers": first, "layer_frequency": step}


def _listed(indices: object) -> str:
    """A list of block indices short enough for a one-line message."""
    if not isinstance(indices, list) or len(indices) <= 6:
        return repr(indices)[:80]
    return f"[{', '.join(map(repr, indices[:5]))}, … ({len(indices)} entries)]"


def mla_fields(cfg: Any, where: str) -> dict[str, Any]:
    """`MLASpec` fields of a deepseek_v2 / deepseek_v3 config."""
    fields = {key: getattr(cfg, key, None) for key in MLA_FIELDS}
    for key in MLA_FIELDS[1:]:
        _count(cfg, key, where, 1)
    if fields["q_lora_rank"] is not None:
        _count(cfg, "q_lora_rank", where, 1)
    return fields


def refuse_unmodelled(cfg: Any, where: str) -> None:
    """What a MoE config may hold that `ModelSpec` cannot say."""
    mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    if mtp:
        raise SpecError(
            "num_nextn_predict_layers",
            f"{mtp}: multi-token prediction modules (DeepSeek-V3 §2.2; 14B parameters in its checkpoint) "
            "are not modelled, and transformers builds none; set it to 0 to plan the main model",
            where,
        )
