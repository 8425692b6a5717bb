"""Megatron-Core's fine-grained selective recompute (Workload.recompute_modules, costmodel/recompute.py):
what each module frees and re-runs, checked against hand-computed bytes, and where it applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.calibrate.runs import load_runs
from service.catalog import load_model
from service.costmodel.estimate import estimate
from service.spec import ClusterSpec, Plan, SpecError, Workload, load_experiment
from service.spec.errors import validate_as

SEQ = 4096
H100 = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
ROOT = Path(__file__).resolve().parents[2]
SELECTIVE = dict(engine="megatron", zero_stage=1, grad_accum=8, recompute="selective")


def work(*modules: str, **extra) -> Workload:
    chosen = {"recompute_modules": modules} if modules else {}
    return Workload(seq_len=SEQ, global_batch_sequences=256, tokens_to_train=1e12, **chosen, **extra)


def activations(model, plan, workload) -> float:
    return estimate(model, H100, plan, workload).memory_per_gpu_bytes.activations


def test_core_attn_alone_is_the_default_and_layernorm_frees_both_norm_outputs():
    """Llama-3-8B, tp 2 with sequence parallelism, bf16: each norm's output is 2 bytes × 4,096 / 2
    features per token, so both over 4,096 tokens and 32 blocks are 2 × 4,096 × 4,096 × 32 bytes, 1 GiB."""
    model = load_model("llama3-8b")
    plan = Plan(dp=32, tp=2, sequence_parallel=True, **SELECTIVE)
    default = activations(model, plan, work())
    assert activations(model, plan, work("core_attn")) == default
    assert default - activations(model, plan, work("core_attn", "layernorm")) == pytest.approx(2**30)
    # the dense MLP checkpointed: its fc1 output (2f) and fc2 input (f), 3 × 14,336 × 2 bytes / tp 2
    freed = default - activations(model, plan, work("core_attn", "mlp"))
    assert freed == pytest.approx(3 * 14336 * SEQ * 32)


def test_mla_up_proj_frees_the_up_projected_q_k_and_v():
    """DeepSeek-V3: 128 heads of 192-wide queries and keys and 128-wide values, d·(q + k + v)/tp =
    2 × (24,576 + 24,576 + 16,384) / 2 bytes per token in each of the 61 blocks."""
    model = load_model("deepseek-v3")
    plan = Plan(dp=32, tp=2, ep=32, sequence_parallel=True, **SELECTIVE)
    freed = activations(model, plan, work()) - activations(model, plan, work("core_attn", "mla_up_proj"))
    assert freed == pytest.approx(65536 * SEQ * 61)


def test_moe_act_frees_fc2_inputs_and_moe_keeps_no_expert_tensors_but_replays_the_all_to_all():
    """Mixtral 8x7B on ep 8: each token's 2 routes × the dropless load factor 1.5 keep fc2's input,
    14,336 × 2 bytes, in each of 32 blocks; "moe" re-runs the whole layer, dispatch and combine too."""
    model = load_model("mixtral-8x7b")
    plan = Plan(dp=64, ep=8, engine="megatron", zero_stage=1, grad_accum=4, recompute="selective")
    default, act, whole = (
        estimate(model, H100, plan, work(*m)) for m in ((), ("core_attn", "moe_act"), ("core_attn", "moe"))
    )
    mem = [e.memory_per_gpu_bytes.activations for e in (default, act, whole)]
    assert mem[0] - mem[1] == pytest.approx(SEQ * 2 * 1.5 * 14336 * 2 * 32)
    assert mem[2] < mem[1] < mem[0]
    none = estimate(model, H100, plan.model_copy(update={"recompute": "none"}), work())
    assert whole.time_breakdown_s.ep_comm == pytest.approx(1.5 * default.time_breakdown_s.ep_comm)
    assert default.time_breakdown_s.ep_comm == pytest.approx(none.time_breakdown_s.ep_comm)
    assert whole.time_breakdown_s.recompute > act.time_breakdown_s.recompute > 0


def test_other_engines_are_not_changed_by_megatron_modules():
    model = load_model("mixtral-8x7b")
    plan = Plan(dp=64, ep=8, engine="fsdp", zero_stage=3, grad_accum=4, recompute="selective")
    default, moe = (estimate(model, H100, plan, w) for w in (work(), work("layernorm", "moe")))
    assert moe.memory_per_gpu_bytes == default.memory_per_gpu_bytes and moe.step_time_s == default.step_time_s


def test_published_runs_that_recompute_their_moe_layers_are_predicted_to_fit():
    """NVIDIA's model zoo ran Qwen3-235B at 16-128K on 256 H100s recomputing its norms and MoE layers;
    without the modules every one of those layouts was over 150 GiB per GPU."""
    runs = load_runs(ROOT / "benchmarks/published/moe_measurements.yaml")
    recomputed = [r for r in runs if "moe" in r.workload.recompute_modules]
    assert len(recomputed) >= 8
    for run in recomputed:
        assert estimate(run.model, run.cluster, run.plan, run.workload).fits, run.id


def test_recompute_modules_is_megatrons_and_one_policy(tmp_path):
    both = dict(seq_len=SEQ, global_batch_sequences=8, tokens_to_train=1e9, recompute_modules=["moe"])
    with pytest.raises(SpecError) as info:
        validate_as(Workload, {**both, "selective_recompute": "every_other_block"})
    assert info.value.field == "recompute_modules" and "one of the two" in info.value.message
    data = yaml.safe_load((ROOT / "experiments/llama2-13b-32xh100.yaml").read_text())
    data["workload"]["recompute_modules"] = ["layernorm"]
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    assert info.value.field == "workload.recompute_modules"
    assert "add megatron to engines" in info.value.message
    data["workload"]["recompute_modules"] = ["attention"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        load_experiment(path)
    assert info.value.field.startswith("workload.recompute_modules")


def test_mlp_frees_the_dense_blocks_mlp_at_their_own_width_on_the_stage_that_holds_them():
    """DeepSeek-V3 on pp 16: the first stage holds the three dense blocks (MLP 18,432 wide) and one MoE
    block. "mlp" checkpoints the dense MLPs: 3 × (2 × 18,432 × 2 + 18,432 × 2) / tp 8 bytes per token
    (fc1's gate and up outputs, fc2's input; bf16) in each of the stage's micro-batches in flight. It
    was the mean MLP width's share, spread over every block of every stage."""
    from service.costmodel import memory as mem

    model = load_model("deepseek-v3")
    plan = Plan(dp=4, tp=8, pp=16, ep=32, sequence_parallel=True, **{**SELECTIVE, "grad_accum": 64})
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=64)

    def saved(*modules: str) -> float:
        return estimate(model, cluster, plan, work(*modules)).memory_per_gpu_bytes.activations

    freed = saved() - saved("core_attn", "mlp")
    in_flight = float(mem.micro_batches_in_flight(16, 64, 1))
    assert freed == pytest.approx(3 * 6 * 18432 / 8 * SEQ * in_flight)
