"""DeepSpeed's ZeRO-3 before 0.6 (Workload.zero3_collectives = "per_tensor_lists"): one reduce-scatter per
parameter tensor, PyTorch's list collectives launching one copy kernel per rank for every call, and a
device synchronise before every module that leaves the reduce-scatters unhidden."""

from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError

from service.calibrate.runs import load_dataset, model_spec, workload
from service.catalog import load_gpu, load_model
from service.costmodel import comm, estimate
from service.spec import ClusterSpec, ModelSpec, Plan, Workload
from service.spec.params import ModelParams
from service.spec.zero import ZeroKnobs

A100 = load_gpu("a100-sxm-80gb")
GPT3 = load_model("gpt3-175b")
PRIOR = ModelParams()
DATA = "benchmarks/published/measurements.yaml"


def _work(collectives: str, **kw) -> Workload:
    return Workload(
        seq_len=2048, global_batch_sequences=1536, tokens_to_train=1e9, zero3_collectives=collectives, **kw
    )


def _dp_comm(plan: Plan, collectives: str, dp: int = 1536) -> float:
    cluster = ClusterSpec(gpu="a100-sxm-80gb", num_nodes=dp // 8)
    return estimate(GPT3, cluster, plan, _work(collectives), params=PRIOR).time_breakdown_s.dp_comm


def test_parameter_tensors_per_block_count_weights_norms_and_biases():
    assert GPT3.linear_biases and GPT3.parameter_tensors_per_block == 12  # Megatron GPT: 6 × (weight, bias)
    assert load_model("llama2-70b").parameter_tensors_per_block == 9  # q k v o gate up down + 2 RMSNorms
    bare = ModelSpec(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=100, mlp="gelu"
    )
    assert bare.weight_matrices_per_block == 4 and bare.parameter_tensors_per_block == 6
    # Biases are tensors, not counted parameters: the count of elements does not move.
    assert bare.model_copy(update={"linear_biases": True}).num_params == bare.num_params


def test_per_tensor_lists_add_the_copies_and_the_extra_reduce_scatters():
    """GPT-3 175B on 1,536 A100s, ZeRO-3, one micro-batch: the collectives outlast the compute, so every
    extra second of them shows in the step: 1,536 copy launches for each of 11 gathers and 12
    reduce-scatters per block, plus the ring latency of the 8 extra reduce-scatters per block."""
    plan = Plan(dp=1536, zero_stage=3, micro_batch=1, grad_accum=1, recompute="full")
    flat, legacy = _dp_comm(plan, "flat"), _dp_comm(plan, "per_tensor_lists")
    # 4 gathers per block in forward, 4 in the recomputed forward and 3 again in backward (QKV, attention
    # out, MLP in: data_parallel.regathered_fraction), 12 reduce-scatters.
    copies = (4 + 4 + 3 + 12) * GPT3.num_layers * 1536 * A100.kernel_overhead_us * 1e-6
    latency = (12 - 4) * GPT3.num_layers * float(comm.ring_latency_s(1536, 1, 8, A100, 1))
    assert copies == pytest.approx(16.957440)  # 2,208 calls × 1,536 launches × 5 µs
    assert legacy - flat == pytest.approx(copies + latency, rel=1e-6)
    # Twice the ranks, twice the launches per call: the legacy penalty grows with the group.
    half = _dp_comm(
        Plan(dp=768, zero_stage=3, micro_batch=2, grad_accum=1, recompute="full"), "per_tensor_lists", 768
    )
    assert half < legacy


def test_legacy_reduce_scatters_hide_behind_nothing():
    """At 384 GPUs with 4 sequences each, the compute hides every flat collective (each costs only its
    overlap contention). DeepSpeed before 0.6 synchronises the device before each module's backward, so
    its 12 reduce-scatters per block show whole, beside the list copies; its gathers still hide."""
    plan = Plan(dp=384, zero_stage=3, micro_batch=4, grad_accum=1, recompute="full")
    flat, legacy = _dp_comm(plan, "flat", 384), _dp_comm(plan, "per_tensor_lists", 384)
    grads = 2 * GPT3.num_params  # bf16 gradients, tp = pp = 1: the whole model on every rank

    def reduce_scatters(calls: int) -> float:
        return float(comm.reduce_scatter_time_s(grads, 384, 1, 8, A100, calls * GPT3.num_layers))

    copies = (4 + 4 + 3 + 12) * GPT3.num_layers * 384 * A100.kernel_overhead_us * 1e-6
    kappa = PRIOR["overlap_contention"]
    gathers_hidden = flat - kappa * reduce_scatters(4)  # what the flat gathers cost behind compute
    assert flat < 0.4 * reduce_scatters(12)
    assert legacy == pytest.approx(reduce_scatters(12) + copies + gathers_hidden, rel=1e-6)


@pytest.mark.parametrize(
    "plan",
    [
        Plan(dp=1536, zero_stage=1, micro_batch=1, grad_accum=1, recompute="full"),
        Plan(dp=1536, zero_stage=2, micro_batch=1, grad_accum=1, recompute="full"),
        Plan(dp=1536, zero_stage=3, micro_batch=1, grad_accum=1, recompute="full", engine="fsdp"),
    ],
    ids=["zero1", "zero2", "fsdp"],
)
def test_only_deepspeed_zero3_calls_collectives_per_tensor(plan):
    assert _dp_comm(plan, "per_tensor_lists") == _dp_comm(plan, "flat")


def test_the_published_zero3_rows_and_only_they_ran_per_tensor_lists():
    ds = load_dataset(DATA)
    legacy = sorted(r.id for r in ds.measurements if workload(ds, r).zero3_collectives == "per_tensor_lists")
    assert len(legacy) == 6 and all(i.startswith("narayanan-t2-zero3-") for i in legacy)
    assert all(r.zero_stage == 3 for r in ds.measurements if r.id in legacy)


def test_an_unknown_style_names_the_field():
    with pytest.raises(ValidationError, match="zero3_collectives"):
        _work("per_module")
    assert np.isfinite(_dp_comm(Plan(dp=1536, zero_stage=3, micro_batch=1, grad_accum=1), "flat"))


def test_deepspeed_holds_back_the_gather_after_a_module_of_a_billion_elements(monkeypatch):
    """DeepSpeed prefetches the next module only under stage3_max_live_parameters (1e9 elements): in a
    530B GPT block QKV (1.26e9), MLP in and out (1.68e9 each) hold back, in forward, the gathers of the
    attention output, of MLP out and of the next block's QKV ((1 + 4 + 3)·h² of 12·h² elements) and, in
    backward, of the attention output, MLP in and MLP out ((1 + 4 + 4)·h²)."""
    from service.costmodel.data_parallel import held_back_gather_fraction

    gpt530 = model_spec(load_dataset(DATA), "gpt-529.6b")  # the published set's 530B GPT
    assert held_back_gather_fraction(gpt530, 1, 10**9)[0] == pytest.approx((8 / 12 + 9 / 12) / 2)
    assert held_back_gather_fraction(gpt530, 2, 10**9)[0] == 0.0  # halved by TP, every matrix fits
    for name in ("gpt3-175b", "llama2-70b", "llama3.1-405b"):  # 405B's MLP matrices: 0.87e9
        assert held_back_gather_fraction(load_model(name), 1, 10**9)[0] == 0.0
    cluster = ClusterSpec(gpu="a100-sxm-80gb", num_nodes=80)
    work = _work("flat").model_copy(update={"global_batch_sequences": 2560})
    plan = Plan(dp=640, zero_stage=3, micro_batch=4, recompute="full")
    held = estimate(gpt530, cluster, plan, work, params=PRIOR).time_breakdown_s.dp_comm
    knobs = ZeroKnobs.for_model(gpt530)
    monkeypatch.setattr(
        ZeroKnobs, "for_model", classmethod(lambda cls, m: replace(knobs, stage3_max_live_parameters=10**12))
    )
    free = estimate(gpt530, cluster, plan, work, params=PRIOR).time_breakdown_s.dp_comm
    assert held > 2 * free, (held, free)  # two thirds of the gathers no longer hide behind compute
