"""Every catalog model counts the parameters its publisher states (Hugging Face's count of the released
checkpoint, biases aside: ModelSpec's linear layers carry none)."""

from __future__ import annotations

import pytest

from service.catalog import load_model, model_names

# Parameter counts of the released checkpoints (transformers' num_parameters()), and the relative gap
# ModelSpec may leave: GPT-3 and Qwen2.5 have biases ModelSpec does not count.
PUBLISHED_PARAMS = {
    "llama2-7b": (6_738_415_616, 0.0),
    "llama2-13b": (13_015_864_320, 0.0),
    "llama2-70b": (68_976_648_192, 0.0),
    "llama3-8b": (8_030_261_248, 0.0),
    "llama3-70b": (70_553_706_496, 0.0),
    "llama3.1-405b": (405_853_388_800, 0.0),
    "mistral-7b": (7_241_732_096, 0.0),
    "codellama-34b": (33_743_970_304, 0.0),
    "qwen2.5-7b": (7_615_616_512, 0.001),
    "qwen2.5-72b": (72_706_203_648, 0.001),
    "gpt3-175b": (175e9, 0.01),  # Brown et al. 2020, Table 2.1 ("175.0B")
    # Mixture-of-experts models: transformers' count of the model it builds (tests/spec/test_hf_moe.py),
    # less the q/k RMSNorm weights ModelSpec leaves out (Qwen3, OLMoE: ~1e-5).
    "mixtral-8x7b": (46_702_792_704, 0.0),
    "mixtral-8x22b": (140_620_634_112, 0.0),
    "qwen3-30b-a3b": (30_532_122_624, 1e-6),
    "qwen3-235b-a22b": (235_093_634_560, 1e-6),
    "deepseek-v3": (671_026_404_352, 0.0),  # the main model; the multi-token prediction module is not in it
    "deepseek-v2-lite": (15_706_484_224, 0.0),
    "olmoe-1b-7b": (6_919_161_856, 1e-5),
}


def test_every_catalog_model_has_a_published_count() -> None:
    assert set(model_names()) == set(PUBLISHED_PARAMS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_catalog_model_counts_its_published_parameters(name: str) -> None:
    count, gap = PUBLISHED_PARAMS[name]
    assert load_model(name).num_params == pytest.approx(count, rel=gap, abs=0 if gap else 0.5)


def rounded(figure: float, unit: float) -> tuple[float, float]:
    """The counts a publisher writes as `figure` when it rounds to `unit`."""
    return figure - unit / 2, figure + unit / 2


def truncated(figure: float, unit: float) -> tuple[float, float]:
    """The counts a publisher writes as `figure` when it cuts the digits below `unit`."""
    return figure, figure + unit


# Publishers' total and active parameters (billions), each with the rounding its figures show, and whether
# their active count includes the input embedding (a lookup): Mistral AI, Qwen and AI2 count it, DeepSeek
# does not (DeepSeek-V3's README_WEIGHTS.md: 36.6B activated with the 0.9B output head; with the
# embedding it would be 37.5B). Qwen3-30B-A3B's 3.35B and DeepSeek-V2-Lite's 2.45B are written 3.3B and
# 2.4B: cut, not rounded, where Mixtral's 12.88B is written 12.9B and OLMoE's 1.28B 1.3B.
MOE_PUBLISHED = {
    # Mistral AI, "Mixtral of experts" (2023-12-11): 46.7B total, 12.9B active.
    "mixtral-8x7b": (rounded(46.7, 0.1), rounded(12.9, 0.1), True),
    # Mistral AI, "Cheaper, Better, Faster, Stronger" (2024-04-17): 141B, 39B active.
    "mixtral-8x22b": (rounded(141, 1), rounded(39, 1), True),
    # Qwen/Qwen3-30B-A3B model card: 30.5B in total and 3.3B activated.
    "qwen3-30b-a3b": (rounded(30.5, 0.1), truncated(3.3, 0.1), True),
    # Qwen/Qwen3-235B-A22B model card: 235B in total and 22B activated.
    "qwen3-235b-a22b": (rounded(235, 1), rounded(22, 1), True),
    # DeepSeek-V3 (arXiv 2412.19437, §1) 671B total, 37B activated; README_WEIGHTS.md: 671B main model
    # (685B with the 14B multi-token prediction module), 36.6B activated.
    "deepseek-v3": (rounded(671, 1), rounded(36.6, 0.1), False),
    # DeepSeek-V2 (arXiv 2405.04434), Appendix B: V2-Lite 15.7B total, 2.4B activated.
    "deepseek-v2-lite": (rounded(15.7, 0.1), truncated(2.4, 0.1), False),
    # OLMoE (arXiv 2409.02060), allenai/OLMoE-1B-7B-0924 model card: 6.9B total, 1.3B active.
    "olmoe-1b-7b": (rounded(6.9, 0.1), rounded(1.3, 0.1), True),
}


@pytest.mark.parametrize("name", sorted(MOE_PUBLISHED))
def test_moe_model_counts_its_publishers_total_and_active_parameters(name: str) -> None:
    (total_low, total_high), (active_low, active_high), with_embedding = MOE_PUBLISHED[name]
    model = load_model(name)
    active = model.active_params - (0 if with_embedding else model.vocab_size * model.hidden_size)
    assert total_low <= model.num_params / 1e9 < total_high
    assert active_low <= active / 1e9 < active_high
