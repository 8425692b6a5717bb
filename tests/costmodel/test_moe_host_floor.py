"""A MoE block pass cannot beat its host time (costmodel/compute.py `moe_host_floor_s`, ModelParams
moe_block_host_s): a small micro-batch's blocks wait for it, a large one's hide it, a dense model and a
megatron plan that replays the MoE preprocessing from CUDA graphs pay nothing. Checked on
Qwen3-30B-A3B's 16-H100 layout from Megatron-Bridge's tables (48 MoE blocks, EP 16, micro-batch 1)."""

from __future__ import annotations

import pytest

from service.catalog import load_model
from service.costmodel.estimate import estimate
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import load_params
from tests.costmodel.conftest import seed_experiment_with

QWEN = load_model("qwen3-30b-a3b")
CLUSTER = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=2)
PLAN = Plan(dp=16, ep=16, engine="megatron", zero_stage=1, grad_accum=64, comm_overlap=True)
HOST_S = 0.02
PRIOR, FLOORED = (load_params().with_values({"moe_block_host_s": h}) for h in (0.0, HOST_S))


def _estimate(params, plan=PLAN, model=QWEN, **workload):
    work = Workload(
        seq_len=4096, global_batch_sequences=1024, tokens_to_train=1e9, moe_load_imbalance=1.0, **workload
    )
    return estimate(model, CLUSTER, plan, work, params=params)


def _passes_s(e) -> float:
    """The step's 64 micro-batch passes (pp 1: no bubble), the optimizer step included."""
    t = e.time_breakdown_s
    return t.compute + t.recompute + t.tp_comm + t.cp_comm + t.pp_comm + t.ep_comm


def test_a_pass_shorter_than_the_host_time_waits_for_it():
    free, held = _estimate(PRIOR), _estimate(FLOORED)
    # Each micro-batch's 48 block passes take at least 48 × 20 ms = 0.96 s, more than their GPU work:
    # the wait is booked as overhead, ga × (0.576 s − the pass), and nothing else moves.
    assert _passes_s(free) < 64 * 48 * HOST_S
    waited = held.time_breakdown_s.host_wait
    assert free.time_breakdown_s.host_wait == 0.0
    assert waited == pytest.approx(64 * 48 * HOST_S - _passes_s(free), abs=0.05)  # the optimizer step's
    assert held.step_time_s == pytest.approx(free.step_time_s + waited)
    assert held.tokens_per_s == pytest.approx(free.tokens_per_s * free.step_time_s / held.step_time_s)
    assert held.step_time_s > 1.5 * free.step_time_s
    for term in ("compute", "ep_comm", "dp_comm", "overhead"):
        assert getattr(held.time_breakdown_s, term) == getattr(free.time_breakdown_s, term)


def test_a_large_micro_batch_hides_it():
    # Micro-batch 16: each pass carries 16× the tokens, far more GPU work than 48 × 20 ms.
    plan = PLAN.model_copy(update={"micro_batch": 16, "grad_accum": 4})
    assert _estimate(FLOORED, plan).step_time_s == pytest.approx(_estimate(PRIOR, plan).step_time_s)


def test_cuda_graphs_of_the_moe_preprocessing_lift_it_on_megatron_only():
    graphed = {"cuda_graph_scope": ("moe_router", "moe_preprocess")}
    assert _estimate(FLOORED, **graphed).step_time_s == pytest.approx(_estimate(PRIOR, **graphed).step_time_s)
    attention_only = {"cuda_graph_scope": ("attn",)}  # the MoE block still runs eagerly
    assert _estimate(FLOORED, **attention_only).step_time_s > _estimate(PRIOR, **attention_only).step_time_s
    # DeepSpeed has no such capture: the same scope changes nothing there.
    ds = PLAN.model_copy(update={"engine": "deepspeed", "comm_overlap": False})
    assert _estimate(FLOORED, ds, **graphed).step_time_s > _estimate(PRIOR, ds, **graphed).step_time_s


def test_a_dense_model_has_no_moe_block_to_wait_for():
    llama = load_model("llama3-8b")
    plan = Plan(dp=16, engine="megatron", zero_stage=1, grad_accum=64)
    assert _estimate(FLOORED, plan, llama).step_time_s == _estimate(PRIOR, plan, llama).step_time_s


def test_deepspeeds_expert_loop_adds_host_time_per_local_expert():
    """DeepSpeed calls each local expert's module in a Python loop (moe/experts.py): its rule adds host
    time per local expert, measured by benchmarks/moe_host_time.py; the grouped layers add none."""
    from service.spec.engine import engine_rules

    per_expert = engine_rules("deepspeed").expert_parallel.host_s_per_local_expert
    assert 1e-4 < per_expert < 2e-3
    assert engine_rules("megatron").expert_parallel.host_s_per_local_expert == 0.0
    assert engine_rules("fsdp").expert_parallel.host_s_per_local_expert == 0.0
    # EP 2 on DeepSpeed: 64 local experts per rank. With the block term at 0, each of a micro-batch's 48
    # block passes still takes at least 64 × per_expert on the host, longer than its GPU work.
    ds = PLAN.model_copy(update={"engine": "deepspeed", "comm_overlap": False, "ep": 2})
    e = _estimate(PRIOR, ds)
    floor = 48 * 64 * per_expert
    assert _passes_s(e) < 64 * floor
    assert e.time_breakdown_s.host_wait == pytest.approx(64 * floor - _passes_s(e), abs=0.05)
    # Megatron's grouped layer adds none: the same layout waits for nothing with the block term at 0.
    megatron = ds.model_copy(update={"engine": "megatron", "comm_overlap": True})
    assert _estimate(PRIOR, megatron).time_breakdown_s.host_wait == 0.0


def test_the_cpu_stand_in_has_no_device_queue_to_wait_on():
    # A tiny MoE proxy: each block pass is far shorter than 20 ms on an H100, and on the CPU stand-in too.
    from service.spec import ModelSpec
    from service.spec.moe_spec import MoESpec

    tiny = ModelSpec(
        name="tiny-moe", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        vocab_size=256, moe=MoESpec(num_experts=4, experts_per_token=2, expert_ffn_hidden_size=64),
    )  # fmt: skip
    plan = Plan(dp=2, ep=2, zero_stage=1, grad_accum=1)
    work = Workload(seq_len=64, global_batch_sequences=2, tokens_to_train=1e6)
    for gpu, waits in (("h100-sxm-80gb", True), ("cpu", False)):
        cluster = ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=2)
        free, held = (estimate(tiny, cluster, plan, work, params=p).step_time_s for p in (PRIOR, FLOORED))
        assert (held > free + HOST_S) if waits else held == free  # 2 blocks × 20 ms over ~1 ms of work


def test_bad_cuda_graph_scope_is_one_line_naming_the_field(tmp_path, capsys):
    from service.cli.main import main
    from service.spec import SpecError, load_experiment
    from service.spec.errors import validate_as

    with pytest.raises(SpecError) as info:
        validate_as(Workload, dict(seq_len=4096, global_batch_sequences=8, tokens_to_train=1e9,
                                   cuda_graph_scope=["moe_routr"]))  # fmt: skip
    assert info.value.field.startswith("cuda_graph_scope") and "moe_router" in info.value.message
    with pytest.raises(SpecError) as info:
        load_experiment(seed_experiment_with(tmp_path, cuda_graph_scope=["moe_router", "moe_preprocess"]))
    assert info.value.field == "workload.cuda_graph_scope" and "add megatron to engines" in info.value.message
    flags = ["estimate", "--model", "qwen3-30b-a3b", "--gpu", "h100-sxm-80gb", "--gpus", "16", "--ep", "16"]
    flags += ["--zero", "1", "--grad-accum", "64", "--cuda-graph-scope", "moe_router", "moe_preprocess"]
    assert main(flags) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--cuda-graph-scope" in err and "engine megatron" in err
    assert main([*flags, "--engine", "megatron", "--json"]) == 0
    assert '"cuda_graph_scope": [\n      "moe_router",' in capsys.readouterr().out
