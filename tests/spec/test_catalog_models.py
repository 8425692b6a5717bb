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
}


def test_every_catalog_model_has_a_published_count() -> None:
    assert set(model_names()) == set(PUBLISHED_PARAMS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_catalog_model_counts_its_published_parameters(name: str) -> None:
    count, gap = PUBLISHED_PARAMS[name]
    assert load_model(name).num_params == pytest.approx(count, rel=gap, abs=0 if gap else 0.5)
