"""The spec layer on bad input: one `SpecError` naming the file, the field and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from service.catalog import load_gpu, load_model
from service.spec import ClusterSpec, ExperimentSpec, Plan, SpecError, Workload, check_plan, load_experiment
from service.spec.errors import validate_as

EXPERIMENT = Path(__file__).resolve().parents[2] / "experiments" / "llama2-13b-32xh100.yaml"


def experiment_file(tmp_path: Path, edit, name: str = "exp") -> Path:
    data = yaml.safe_load(EXPERIMENT.read_text())
    edit(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_of(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    return info.value


@pytest.mark.parametrize(
    ("edit", "field", "fragment"),
    [
        (
            lambda d: d.update(nmae=d.pop("name")),
            "nmae",
            "unknown field; allowed: alternatives, budget, cluster, engines, goodput, model, name",
        ),
        (
            lambda d: d["cluster"].update(gpus=8),
            "cluster.gpus",
            "allowed: gpu, gpus_per_node, inter_node_bandwidth_gb_per_s, num_nodes",
        ),
        (
            lambda d: d["cluster"].update(inter_node_bandwidth_gb_per_s=0),
            "cluster.inter_node_bandwidth_gb_per_s",
            "greater than or equal to 0.01",
        ),
        (lambda d: d["budget"].update(max_dollars=-1), "budget.max_dollars", "greater than 0"),
        (lambda d: d["budget"].update(max_hours=0), "budget.max_hours", "greater than 0"),
        (lambda d: d["budget"].update(memory_headroom=1.0), "budget.memory_headroom", "less than 1"),
        (lambda d: d["budget"].update(objective="fast"), "budget.objective", "'throughput' or 'cost'"),
        (
            lambda d: d["cluster"].update(gpu="h900"),
            "cluster.gpu",
            "allowed: a100-sxm-40gb, a100-sxm-80gb, b200-sxm-180gb, cpu, gb200-nvl72",
        ),
        (lambda d: d.update(model="llama9"), "model", "allowed: codellama-34b, deepseek-v2-lite"),
        (lambda d: d["cluster"].update(gpus_per_node=0), "cluster.gpus_per_node", "greater than 0"),
        (
            lambda d: d["workload"].update(global_batch_tokens=1000),
            "workload",
            "not a multiple of seq_len 4096",
        ),
        (lambda d: d["workload"].pop("global_batch_sequences"), "workload", "give global_batch_sequences or"),
        (lambda d: d.pop("workload"), "workload", "Field required"),
        (lambda d: d.update(engines=["torch"]), "engines.0", "'deepspeed', 'fsdp' or 'megatron'"),
        (lambda d: d.update(engines=[]), "engines", "at least 1 item"),
        (lambda d: d.update(optimizer={"lr": -1}), "optimizer.lr", "greater than 0"),
        (lambda d: d.update(optimizer={"warmup": 0.1}), "optimizer.warmup", "allowed: lr, min_lr_ratio"),
        (lambda d: d.update(engines=["fsdp", "fsdp"]), "engines", "engines listed twice"),
        (
            lambda d: d["workload"].update(selective_recompute="every_other_block"),
            "workload.selective_recompute",
            "not what the service's DeepSpeed worker runs",
        ),
        (
            lambda d: d["workload"].update(selective_recompute="op"),
            "workload.selective_recompute",
            "'attention_block', 'every_other_block' or 'every_other_matmul'",
        ),
        # pydantic alone would read true as 1 (one node) and plan for it without a word
        (
            lambda d: d["cluster"].update(num_nodes=True),
            "cluster.num_nodes",
            "expected a number, got true/false",
        ),
        (
            lambda d: d["workload"].update(seq_len=True),
            "workload.seq_len",
            "expected a number, got true/false",
        ),
        (lambda d: d["budget"].update(max_dollars=False), "budget.max_dollars", "expected a number"),
        (
            lambda d: d.update(alternatives=[{"cluster": {"gpu": "a100-sxm-80gb", "num_nodes": True}}]),
            "alternatives.0.cluster.num_nodes",
            "expected a number, got true/false",
        ),
    ],
)
def test_experiment_errors_name_file_field_and_allowed(tmp_path, edit, field, fragment):
    err = error_of(experiment_file(tmp_path, edit))
    assert err.source is not None and err.source.endswith("exp.yaml")
    assert err.field == field
    assert fragment in err.message
    assert "\n" not in str(err)


def test_other_recompute_policies_plan_engines_the_worker_does_not_run(tmp_path):
    def fsdp_only(d):
        d["workload"].update(selective_recompute="every_other_matmul")
        d.update(engines=["fsdp"])

    spec = load_experiment(experiment_file(tmp_path, fsdp_only))
    assert spec.workload.selective_recompute == "every_other_matmul"


def test_booleans_stay_welcome_where_a_boolean_belongs(tmp_path):
    path = experiment_file(tmp_path, lambda d: d["workload"].update(flash_attention=False))
    assert load_experiment(path).workload.flash_attention is False


def test_misspelt_key_is_reported_before_the_missing_field(tmp_path):
    err = error_of(
        experiment_file(tmp_path, lambda d: d["workload"].update(seqlen=d["workload"].pop("seq_len")))
    )
    assert err.field == "workload.seqlen" and err.message.startswith("unknown field")


def test_model_file_errors_name_the_model_file(tmp_path):
    shape = "num_layers: 2\nhidden_size: 96\nnum_attention_heads: 3\nffn_hidden_size: 64\n"
    (tmp_path / "m.yaml").write_text(shape + "vocab_size: 10\nvocab: 3\n")
    err = error_of(experiment_file(tmp_path, lambda d: d.update(model="m.yaml")))
    assert (
        err.source == str(tmp_path / "m.yaml")
        and err.field == "vocab"
        and "allowed: ffn_hidden_size" in err.message
    )
    (tmp_path / "m.yaml").write_text(
        "num_layers: 2\nhidden_size: 96\nnum_attention_heads: 3\nffn_hidden_size: 64\n"
    )
    load_model.cache_clear()
    assert error_of(experiment_file(tmp_path, lambda d: d.update(model="m.yaml"))).field == "vocab_size"
    err = error_of(experiment_file(tmp_path, lambda d: d.update(model="missing.yaml")))
    assert err.message == "no such file" and err.source == str(tmp_path / "missing.yaml")


def test_inline_model_shape_errors(tmp_path):
    inline = {
        "num_layers": 2,
        "hidden_size": 100,
        "num_attention_heads": 3,
        "ffn_hidden_size": 8,
        "vocab_size": 5,
    }
    err = error_of(experiment_file(tmp_path, lambda d: d.update(model=inline)))
    assert err.field == "model" and "hidden_size 100 is not divisible by num_attention_heads 3" in err.message
    gqa = {**inline, "hidden_size": 96, "num_key_value_heads": 2}
    err = error_of(experiment_file(tmp_path, lambda d: d.update(model=gqa)))
    assert "not divisible by num_key_value_heads 2" in err.message


def test_unreadable_files(tmp_path):
    from service.spec.experiment import read_yaml

    assert error_of(tmp_path / "none.yaml").message == "no such file"
    assert error_of(tmp_path).message == "a directory, not a YAML file"
    (tmp_path / "bad.yaml").write_text("name: [x\n")
    err = error_of(tmp_path / "bad.yaml")
    assert err.field.startswith("line ") and "not valid YAML" in err.message
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert error_of(tmp_path / "list.yaml").message == "expected a mapping of experiment fields"
    # a key given twice: YAML would keep the last silently (a search space searching one stage of three)
    (tmp_path / "twice.yaml").write_text("name: x\nproxy:\n  steps: 5\n  num_layers: 2\n  steps: 3\n")
    err = error_of(tmp_path / "twice.yaml")
    assert err.field == "line 5" and err.message == "not valid YAML: duplicate key 'steps'"
    # YAML merge keys are no duplicates: `<<: *anchor` merges, a key after it overrides
    (tmp_path / "merge.yaml").write_text("base: &b {tp: 2, pp: 1}\nplan: {<<: *b, tp: 4}\n")
    assert read_yaml(tmp_path / "merge.yaml")["plan"] == {"tp": 4, "pp": 1}


def test_catalog_lookups_list_what_exists():
    with pytest.raises(
        SpecError,
        match="allowed: a100-sxm-40gb, a100-sxm-80gb, b200-sxm-180gb, cpu, gb200-nvl72, h100-sxm-80gb",
    ):
        load_gpu("v100")
    with pytest.raises(SpecError, match="allowed: codellama-34b, deepseek-v2-lite, deepseek-v3, gpt3-175b"):
        load_model("gpt-5")


def test_cluster_from_gpu_count_needs_whole_nodes():
    gpu = load_gpu("h100-sxm-80gb")
    assert ClusterSpec.from_gpu_count(gpu, 32).num_nodes == 4
    assert ClusterSpec.from_gpu_count(gpu, 4).gpus_per_node == 4  # less than a node: one partial node
    with pytest.raises(ValueError, match="not a whole number of nodes"):
        ClusterSpec.from_gpu_count(gpu, 12)
    with pytest.raises(ValueError, match="positive"):
        ClusterSpec.from_gpu_count(gpu, 0)


def test_plan_errors_name_the_field():
    model, cluster = load_model("llama2-13b"), ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=1e9)
    cases = [
        (Plan(dp=2, tp=16, grad_accum=64), "plan.tp", "tp 16 does not divide num_attention_heads 40"),
        (
            Plan(pp=32, virtual_stages=2, engine="megatron", grad_accum=128),
            "plan.virtual_stages",
            "pp·virtual_stages = 64 exceeds num_layers 40",
        ),
        (Plan(dp=16, grad_accum=8), "plan.dp", "dp·tp·pp·cp = 16 but the cluster has 32 GPUs"),
        (Plan(dp=32, grad_accum=3), "plan.grad_accum", "global batch is 128 sequences"),
    ]
    for plan, field, message in cases:
        with pytest.raises(SpecError) as info:
            check_plan(plan, model, cluster, workload)
        assert info.value.field == field and message in info.value.message
    with pytest.raises(SpecError) as info:
        validate_as(Plan, {"tp": 2, "zero_stage": 3}, "space.yaml", prefix="plan")
    assert (
        str(info.value)
        == "space.yaml: plan.zero_stage: DeepSpeed's AutoTP training and the service's tensor-parallel "
        "layers run with ZeRO 0-2; with tp > 1 deepspeed supports zero_stage 0, 1 or 2 only"
    )
    with pytest.raises(
        SpecError, match=r"^space\.yaml: plan\.offload_params: parameter offload needs zero_stage 3$"
    ):
        validate_as(Plan, {"offload_params": True, "zero_stage": 2}, "space.yaml", prefix="plan")
    with pytest.raises(ValidationError):  # direct construction still refuses impossible combinations
        Plan(sequence_parallel=True)


def test_experiment_spec_rejects_unknown_keys_in_python_too():
    data = yaml.safe_load(EXPERIMENT.read_text())
    with pytest.raises(SpecError, match=r"proxy\.num_gpus: unknown field; allowed: checkpoint_every"):
        validate_as(ExperimentSpec, {**data, "proxy": {"num_gpus": 2}}, "inline")
