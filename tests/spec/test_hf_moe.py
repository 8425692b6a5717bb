"""Hugging Face mixture-of-experts configs (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3) as ModelSpecs: the
catalog entry each copies, transformers' own parameter count, and one-line refusals naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.catalog import load_model
from service.spec.errors import SpecError
from service.spec.hf_config import load_hf_config, model_spec_from_hf

DATA = Path(__file__).parent / "data" / "hf_configs"  # the shape and routing fields of each config.json

# What transformers 5 counts for the model it builds from each config (`num_parameters()` of
# AutoModelForCausalLM.from_config on the meta device), and what ModelSpec leaves out: Qwen3's and
# OLMoE's q/k RMSNorm weights (2 × head_dim, and h + kv·head_dim, per block). DeepSeek-V3's count is the
# main model's: transformers builds no multi-token prediction module.
TRANSFORMERS_PARAMS = {
    "mixtral-8x7b": (46_702_792_704, 0),
    "mixtral-8x22b": (140_620_634_112, 0),
    "qwen3-30b-a3b": (30_532_122_624, 48 * 2 * 128),
    "qwen3-235b-a22b": (235_093_634_560, 94 * 2 * 128),
    "deepseek-v3": (671_026_404_352, 0),
    "deepseek-v2-lite": (15_706_484_224, 0),
    "olmoe-1b-7b": (6_919_161_856, 16 * 2 * 2048),
}


def config(name: str, **changes: object) -> dict:
    data = json.loads((DATA / f"{name}.json").read_text())
    if name == "deepseek-v3":
        data["num_nextn_predict_layers"] = 0  # the published 1 is refused (see below)
    return {**data, **changes}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_PARAMS))
def test_config_is_the_catalog_model_and_counts_what_transformers_builds(name: str) -> None:
    spec = model_spec_from_hf(config(name), name)
    assert spec == load_model(name)
    assert spec.model_dump() == load_model(name).model_dump()
    count, left_out = TRANSFORMERS_PARAMS[name]
    assert spec.num_params == count - left_out


def test_a_config_file_on_disk_loads(tmp_path: Path) -> None:
    folder = tmp_path / "Mixtral-8x7B-v0.1"
    folder.mkdir()
    (folder / "config.json").write_text((DATA / "mixtral-8x7b.json").read_text())
    spec = load_hf_config(folder)
    assert spec.name == "Mixtral-8x7B-v0.1" and spec.moe is not None and spec.moe.num_experts == 8


def test_each_architecture_reads_its_own_keys() -> None:
    v3 = model_spec_from_hf(config("deepseek-v3"))
    assert v3.mla is not None and v3.mla.q_lora_rank == 1536 and v3.head_dim == 192 and v3.v_head_dim == 128
    assert v3.moe is not None and (v3.moe.first_dense_layers, v3.num_moe_layers) == (3, 58)
    assert (v3.moe.num_shared_experts, v3.moe.shared_width) == (1, 2048)
    assert (v3.moe.expert_groups, v3.moe.groups_per_token) == (8, 4)  # node-limited routing
    lite = model_spec_from_hf(config("deepseek-v2-lite")).moe
    assert lite is not None and (lite.expert_groups, lite.groups_per_token) == (1, None)  # greedy
    lite = model_spec_from_hf(config("deepseek-v2-lite"))
    assert lite.mla is not None and lite.mla.q_lora_rank is None
    assert lite.attention_projections[0].name == "q_proj" and lite.moe.shared_width == 2 * 1408
    qwen = model_spec_from_hf(config("qwen3-30b-a3b"))
    assert (qwen.head_dim, qwen.q_width, qwen.hidden_size) == (128, 4096, 2048)
    # Qwen2-MoE (Qwen/Qwen1.5-MoE-A2.7B): one shared expert of its own width, dense blocks by step.
    qwen2 = {
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
    }
    qwen2 |= {"num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936, "num_experts": 60}
    qwen2 |= {
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    }
    spec = model_spec_from_hf(qwen2)
    assert spec.moe is not None and (spec.moe.num_shared_experts, spec.moe.shared_width) == (1, 5632)
    # 14.3B as Qwen states; transformers' 14,315,784,192 also counts q/k/v biases and the shared-expert gate.
    assert spec.num_params == 14_315_784_192 - 24 * (3 * 2048 + 2048)
    every_other = model_spec_from_hf({**qwen2, "decoder_sparse_step": 2})
    assert every_other.moe is not None and every_other.num_moe_layers == 12
    leading = model_spec_from_hf({**qwen2, "mlp_only_layers": [0, 1]})
    assert leading.moe is not None and (leading.moe.first_dense_layers, leading.num_moe_layers) == (2, 22)


def test_routers_are_dropless_unless_the_config_gives_a_capacity() -> None:
    assert model_spec_from_hf(config("mixtral-8x7b")).moe.router == "dropless"
    capped = model_spec_from_hf(config("mixtral-8x7b", capacity_factor=1.25)).moe
    assert (capped.router, capped.capacity_factor) == ("capacity", 1.25)


@pytest.mark.parametrize(
    ("name", "changes", "field", "words"),
    [
        ("mixtral-8x7b", {"num_experts_per_tok": 9}, "num_experts_per_tok", "9 exceeds num_local_experts 8"),
        ("mixtral-8x7b", {"num_local_experts": 0}, "num_local_experts", "0 experts: a mixture-of-experts"),
        ("qwen3-30b-a3b", {"num_experts": 1}, "num_experts", "routes to 2 to 1,048,576"),
        ("qwen3-30b-a3b", {"num_experts": 10**12}, "num_experts", "routes to 2 to 1,048,576"),
        ("qwen3-30b-a3b", {"num_experts_per_tok": 0}, "num_experts_per_tok", "expected at least 1"),
        ("olmoe-1b-7b", {"intermediate_size": 0}, "intermediate_size", "expected at least 1"),
        ("deepseek-v3", {"num_nextn_predict_layers": 1}, "num_nextn_predict_layers", "set it to 0"),
        ("deepseek-v3", {"moe_layer_freq": 2}, "moe_layer_freq", "only 1 is modelled"),
        ("deepseek-v3", {"first_k_dense_replace": 61}, "first_k_dense_replace", "no MoE block among 61"),
        ("deepseek-v3", {"n_routed_experts": None}, "config", "expected int"),
        ("deepseek-v2-lite", {"num_experts_per_tok": None}, "num_experts_per_tok", "expected a whole number"),
        ("qwen3-30b-a3b", {"mlp_only_layers": [5]}, "mlp_only_layers", "other than the leading ones"),
        ("qwen3-30b-a3b", {"mlp_only_layers": list(range(48))}, "mlp_only_layers", "no MoE block"),
        ("qwen3-30b-a3b", {"decoder_sparse_step": 0}, "decoder_sparse_step", "expected at least 1"),
        (
            "qwen3-30b-a3b",
            {"mlp_only_layers": list(range(1, 200_001))},
            "mlp_only_layers",
            "[1, 2, 3, 4, 5, … (200000 entries)]: dense blocks other than the leading ones",
        ),
        ("mixtral-8x7b", {"model_type": "mistral"}, "num_local_experts", "8 experts in a mistral config"),
        ("deepseek-v3", {"n_group": 7}, "n_group", "7 does not divide n_routed_experts 256"),
        ("deepseek-v3", {"topk_group": 9}, "topk_group", "9 exceeds n_group 8"),
    ],
)
def test_bad_moe_configs_are_one_line_naming_the_field(
    name: str, changes: dict, field: str, words: str
) -> None:
    with pytest.raises(SpecError) as err:
        model_spec_from_hf(config(name, **changes), source="config.json")
    message = str(err.value)
    assert f"config.json: {field}" in message and words in message, message
    assert "\n" not in message and len(message) < 400
