"""Attention shapes: a head_dim of its own (Qwen3, Gemma) and DeepSeek's multi-head latent attention, matrix
by matrix as transformers builds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.catalog import load_model
from service.spec.attention import MLASpec
from service.spec.errors import SpecError
from service.spec.model import ModelSpec

DATA = Path(__file__).parent / "data" / "hf_configs"
V3_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _hf_attention_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """Block 0's self_attn parameters of the model transformers builds from the config (meta device)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads((DATA / f"{name}.json").read_text())
    data["num_hidden_layers"] = 1  # one block is enough to read the shapes
    data.pop("quantization_config", None)
    fields = {k: v for k, v in data.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(data["model_type"], **fields))
    attention = model.model.layers[0].self_attn
    return {n.removesuffix(".weight"): tuple(p.shape) for n, p in attention.named_parameters()}


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_projections_are_the_matrices_transformers_builds(name: str) -> None:
    model = load_model(name)
    hf = _hf_attention_shapes(name)
    ours = {
        p.name: (p.out_features, p.in_features) for p in model.attention_projections
    }  # nn.Linear: (out, in)
    latent = {k: v for k, v in hf.items() if k.endswith("_layernorm")}
    assert {k: v for k, v in hf.items() if k not in latent and not k.endswith("_norm")} == ours
    assert sum(v[0] for v in latent.values()) == model.latent_norm_width
    assert model.parameter_tensors_per_block == model.weight_matrices_per_block + 2 + len(latent)


def test_mla_counts_each_projection() -> None:
    v3 = load_model("deepseek-v3")
    h, heads = 7168, 128
    q = h * 1536 + 1536 * heads * 192  # q_a_proj, q_b_proj
    kv = h * (512 + 64) + 512 * heads * (128 + 128)  # kv_a_proj_with_mqa, kv_b_proj
    assert v3.attention_params_per_layer == q + kv + heads * 128 * h  # + o_proj
    assert v3.norm_params_per_layer == 2 * h + 1536 + 512  # block norms and the latent norms
    assert v3.attention_replicated_params_per_layer == h * 1536 + h * (512 + 64)
    assert (v3.head_dim, v3.v_head_dim, v3.q_width, v3.kv_width) == (192, 128, heads * 192, heads * 320)
    assert v3.attention_out_width == heads * 128 and v3.rotary_width == (heads + 1) * 64
    lite = load_model("deepseek-v2-lite")  # no query latent: one q_proj h × heads·192
    assert [p.name for p in lite.attention_projections] == [
        "q_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ]
    assert lite.attention_projections[0].elements == 2048 * 16 * 192 and lite.latent_norm_width == 512


def test_dense_models_keep_their_widths_and_dumps() -> None:
    for name in ("llama2-13b", "llama3-70b", "gpt3-175b"):
        m = load_model(name)
        kv = m.kv_heads * m.hidden_size // m.num_attention_heads
        assert (m.q_width, m.kv_width, m.attention_out_width) == (m.hidden_size, 2 * kv, m.hidden_size)
        assert m.attention_params_per_layer == 2 * m.hidden_size**2 + 2 * m.hidden_size * kv
        assert not {"head_dim", "mla", "moe"} & set(m.model_dump())
    wider = ModelSpec.model_validate({**load_model("llama2-13b").model_dump(), "hidden_size": 2560})
    assert wider.head_dim == 64  # re-derived from the dump, not carried over


def test_explicit_head_dim_and_proxies() -> None:
    qwen = load_model("qwen3-30b-a3b")
    assert qwen.model_dump()["head_dim"] == 128
    proxy = qwen.scaled(num_layers=2, hidden_scale=8)
    assert (proxy.hidden_size, proxy.head_dim, proxy.q_width) == (256, 16, 512)
    v3 = load_model("deepseek-v3").scaled(num_layers=4, hidden_scale=8)
    assert v3.mla is not None and (v3.mla.kv_lora_rank, v3.mla.qk_rope_head_dim, v3.head_dim) == (64, 8, 24)


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"head_dim": 128}, "head_dim", "with mla: its query/key head width is nope + rope = 192"),
        ({"num_key_value_heads": 8}, "num_key_value_heads", "expands keys and values to every head"),
        ({"mla": {**V3_MLA, "kv_lora_rank": 0}}, "mla.kv_lora_rank", "greater than 0"),
        ({"mla": {k: v for k, v in V3_MLA.items() if k != "q_lora_rank"}}, "mla.q_lora_rank", "required"),
    ],
)
def test_bad_attention_fields_name_the_field(fields: dict, field: str, words: str) -> None:
    from service.spec.errors import validate_as

    data = {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16, "ffn_hidden_size": 4096}
    data |= {"vocab_size": 1000, "mla": V3_MLA, **fields}
    with pytest.raises(SpecError) as err:
        validate_as(ModelSpec, data, "m.yaml")
    assert f"m.yaml: {field}: " in str(err.value) and words in str(err.value), str(err.value)


def test_head_dim_frees_the_width_from_the_heads() -> None:
    # 3072 / 16 heads is 192, but Gemma-7B's heads are 256 wide; 1000 / 16 is no width at all.
    gemma = ModelSpec(
        num_layers=1, hidden_size=3072, num_attention_heads=16, head_dim=256, ffn_hidden_size=8, vocab_size=8
    )
    assert gemma.q_width == 4096
    with pytest.raises(ValueError, match="not divisible"):
        ModelSpec(num_layers=1, hidden_size=1000, num_attention_heads=16, ffn_hidden_size=8, vocab_size=8)
    assert MLASpec(**V3_MLA).qk_head_dim == 192
