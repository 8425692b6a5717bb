"""A Hugging Face config.json as the model: the shapes, parameter counts and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.catalog import load_model
from service.spec.errors import SpecError
from service.spec.hf_config import load_hf_config, model_spec_from_hf

REPO = Path(__file__).resolve().parents[2]

# The fields of the published config.json files (meta-llama/Llama-2-13b-hf, mistralai/Mistral-7B-v0.1,
# openai-community/gpt2-xl, mosaicml/mpt-7b), as far as the shapes go.
LLAMA2_13B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 40,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "torch_dtype": "float16",
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
}
GPT2_XL = {
    "model_type": "gpt2",
    "n_embd": 1600,
    "n_head": 25,
    "n_layer": 48,
    "n_ctx": 1024,
    "vocab_size": 50257,
}
MPT_7B = {
    "model_type": "mpt",
    "d_model": 4096,
    "n_heads": 32,
    "n_layers": 32,
    "expansion_ratio": 4,
    "vocab_size": 50432,
    "attn_config": {"attn_type": "multihead_attention", "alibi": True},
}


def _write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def test_llama2_13b_config_is_the_catalog_model(tmp_path: Path) -> None:
    folder = _write(tmp_path / "Llama-2-13b-hf", LLAMA2_13B)
    spec = load_hf_config(folder)
    catalog = load_model("llama2-13b")
    assert spec.name == "Llama-2-13b-hf"
    assert spec.model_dump(exclude={"name"}) == catalog.model_dump(exclude={"name"})
    assert spec.num_params == 13_015_864_320  # what transformers counts for Llama-2-13b-hf
    assert load_model(str(folder / "config.json")) == spec  # the file or its folder


def test_grouped_query_and_plain_mlp_architectures() -> None:
    mistral = model_spec_from_hf(MISTRAL_7B, "mistral-7b")
    assert (mistral.kv_heads, mistral.mlp, mistral.tie_word_embeddings) == (8, "swiglu", False)
    assert mistral.num_params == 7_241_732_096  # Mistral-7B-v0.1's parameter count
    gpt2 = model_spec_from_hf(GPT2_XL)  # GPT-2's own names: n_layer, n_embd, n_head; n_inner unset = 4h
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.num_attention_heads) == (48, 1600, 25)
    assert (gpt2.ffn_hidden_size, gpt2.mlp, gpt2.tie_word_embeddings) == (6400, "gelu", True)
    mpt = model_spec_from_hf(MPT_7B)  # MPT's d_model, n_layers, expansion_ratio
    assert (mpt.num_layers, mpt.hidden_size, mpt.ffn_hidden_size, mpt.kv_heads) == (32, 4096, 16384, 32)


def test_a_head_dim_of_its_own_sizes_the_heads() -> None:
    # google/gemma-7b: 16 heads of 256 on a 3072-wide model (q is 4096 wide); tied embeddings.
    gemma = {"model_type": "gemma", "num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 16}
    gemma |= {"head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000}
    spec = model_spec_from_hf(gemma)
    assert (spec.head_dim, spec.q_width, spec.kv_width, spec.attention_out_width) == (256, 4096, 8192, 4096)
    assert spec.num_params == 8_537_680_896  # what transformers counts for gemma-7b
    # A dump names head_dim only where it is not hidden_size / num_attention_heads.
    assert spec.model_dump()["head_dim"] == 256
    assert "head_dim" not in model_spec_from_hf(MISTRAL_7B).model_dump()
    # 0 is no width (it was read as "left out" and priced 64-wide heads without a word).
    with pytest.raises(SpecError, match=r"head_dim: 0: a positive whole width"):
        model_spec_from_hf(gemma | {"head_dim": 0})


def test_biases_follow_the_architecture_or_its_switch() -> None:
    # GPT-2 biases every linear layer and LayerNorm; Llama none unless both of its switches are on;
    # MPT's default no_bias drops them; OPT's enable_bias and Falcon's bias say it outright.
    assert model_spec_from_hf(GPT2_XL).linear_biases
    assert not model_spec_from_hf(LLAMA2_13B).linear_biases
    assert not model_spec_from_hf({**LLAMA2_13B, "attention_bias": True}).linear_biases
    assert model_spec_from_hf({**LLAMA2_13B, "attention_bias": True, "mlp_bias": True}).linear_biases
    assert not model_spec_from_hf(MPT_7B).linear_biases
    assert model_spec_from_hf({**MPT_7B, "no_bias": False}).linear_biases
    opt = {"model_type": "opt", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16}
    opt |= {"ffn_dim": 4096, "vocab_size": 50272}
    assert (
        model_spec_from_hf(opt).linear_biases
        and not model_spec_from_hf({**opt, "enable_bias": False}).linear_biases
    )
    falcon = {"model_type": "falcon", "num_hidden_layers": 32, "hidden_size": 4544, "num_attention_heads": 71}
    falcon |= {"vocab_size": 65024}
    assert (
        not model_spec_from_hf(falcon).linear_biases
        and model_spec_from_hf({**falcon, "bias": True}).linear_biases
    )
    # Tensors, not elements: a biased GPT block is 12 tensors for DeepSpeed's 2021 per-tensor collectives.
    assert model_spec_from_hf(GPT2_XL).parameter_tensors_per_block == 12


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({**MISTRAL_7B, "num_local_experts": 8}, "num_local_experts", "8 experts in a mistral config"),
        (
            {"model_type": "gpt_neox", "num_hidden_layers": 2, "hidden_size": 1024, "num_attention_heads": 16}
            | {"head_dim": 128, "intermediate_size": 4096, "vocab_size": 50304},
            "head_dim",
            "gpt_neox's attention takes hidden_size / num_attention_heads",
        ),
        ({**LLAMA2_13B, "model_type": "t5"}, "model_type", "MLP kind unknown"),
        ({k: v for k, v in LLAMA2_13B.items() if k != "model_type"}, "model_type", "missing"),
        ({**LLAMA2_13B, "hidden_size": 5121}, "config", "not a multiple of the number of attention heads"),
        ({**GPT2_XL, "head_dim": [64]}, "head_dim", "[64]: a whole number"),
        ({**LLAMA2_13B, "intermediate_size": "x"}, "intermediate_size", "'x': a whole number"),
        ({**GPT2_XL, "num_kv_heads": "x"}, "config", "wrong type or value"),
        ({"model_type": "llava", "text_config": LLAMA2_13B}, "text_config", "save the language model's"),
        ({**LLAMA2_13B, "model_type": "qwen2", "num_hidden_layers": 10**9}, "num_hidden_layers", "to 10,000"),
        ({**LLAMA2_13B, "num_key_value_heads": 0}, "num_key_value_heads", "at least one"),
        # A MoE config without its model_type names the missing key, not the experts.
        (
            {k: v for k, v in MISTRAL_7B.items() if k != "model_type"} | {"num_local_experts": 8},
            "model_type",
            "missing",
        ),
        ({**LLAMA2_13B, "head_dim": "128"}, "head_dim", "'128': a whole number"),
        ({**LLAMA2_13B, "torch_dtype": "bfloat17"}, "torch_dtype", "'bfloat17': not a torch dtype"),
        (
            {"model_type": "opt", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16}
            | {"ffn_dim": 4096, "vocab_size": 50272, "word_embed_proj_dim": 512},
            "word_embed_proj_dim",
            "projected embeddings",
        ),
    ],
)
def test_what_model_spec_cannot_say_is_refused_naming_the_field(data: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        model_spec_from_hf(data, source="config.json")
    assert field in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_a_broken_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="not a JSON file"):
        load_model(str(tmp_path / "config.json"))
    with pytest.raises(SpecError, match="no such file"):
        load_model(str(tmp_path / "missing.json"))


def test_estimate_and_experiments_take_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _write(tmp_path / "llama-2-13b", LLAMA2_13B)
    flags = ["--gpu", "h100-sxm-80gb", "--gpus", "32", "--zero", "3", "--micro-batch", "1", "--json"]

    from service.cli.main import main

    def estimate(model: str) -> dict:
        capsys.readouterr()
        assert main(["estimate", "--model", model, *flags]) == 0
        return json.loads(capsys.readouterr().out)

    from_config, from_catalog = estimate(str(folder)), estimate("llama2-13b")
    assert from_config["tokens_per_s"] == from_catalog["tokens_per_s"] > 0
    assert from_config["memory_per_gpu_bytes"] == from_catalog["memory_per_gpu_bytes"]

    import yaml

    from service.spec import load_experiment

    data = yaml.safe_load((REPO / "experiments" / "llama2-13b-32xh100.yaml").read_text())
    data["model"] = str(folder / "config.json")
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_experiment(path).model.num_params == 13_015_864_320


def test_paths_next_to_the_experiment_and_folders_without_a_config(tmp_path: Path) -> None:
    import yaml

    from service.spec import load_experiment

    exp = tmp_path / "exp"
    _write(exp / "models" / "l13", LLAMA2_13B)
    data = yaml.safe_load((REPO / "experiments" / "llama2-13b-32xh100.yaml").read_text())
    for model in ("models/l13", "models/l13/config.json"):  # relative to the experiment, not the cwd
        (exp / "e.yaml").write_text(yaml.safe_dump({**data, "model": model}))
        assert load_experiment(exp / "e.yaml").model.num_params == 13_015_864_320
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"a folder without a config\.json"):
        load_model(str(tmp_path / "empty"))
    upper = tmp_path / "CONFIG.JSON"
    upper.write_text(json.dumps(MISTRAL_7B))
    assert load_model(str(upper)).num_params == 7_241_732_096
