"""Context parallelism: each engine's rule, and the memory and communication terms of the split."""

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import comm, context, estimate
from service.spec import ClusterSpec, Plan, Workload, plan_problem
from service.spec.params import ModelParams

H100 = load_gpu("h100-sxm-80gb")
LLAMA3_70B = load_model("llama3-70b")  # 64 heads, 8 KV heads of 128, h 8192, 80 layers
PRIOR = ModelParams()
CLUSTER = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)


def _estimate(
    cp: int, engine: str = "deepspeed", seq: int = 32768, dp: int | None = None, recompute: str = "full", **kw
):
    pp = 1 if engine == "deepspeed" else 2  # the service's DeepSpeed runs Ulysses cp without a pipeline
    dp = dp or 64 // (8 * pp * cp)
    plan = Plan(
        dp=dp, tp=8, pp=pp, cp=cp, zero_stage=1, grad_accum=16, recompute=recompute, engine=engine, **kw
    )
    workload = Workload(seq_len=seq, global_batch_sequences=16 * dp, tokens_to_train=1e9)
    return estimate(LLAMA3_70B, CLUSTER, plan, workload, params=PRIOR)


def test_each_engine_has_its_context_parallel_rule():
    workload = Workload(seq_len=4100, global_batch_sequences=2, tokens_to_train=1e9)
    # Ulysses scatters heads: 64 heads / tp 8 = 8 per rank, so cp 16 cannot take whole heads.
    ulysses = Plan(dp=1, tp=8, cp=16, zero_stage=1, grad_accum=2)
    assert plan_problem(ulysses, LLAMA3_70B) == (
        "cp",
        "Ulysses cp 16 does not divide the 8 attention heads per TP rank",
    )
    assert plan_problem(ulysses.model_copy(update={"engine": "megatron"}), LLAMA3_70B) is None
    # Load-balanced ring attention cuts the sequence into 2·cp chunks: 4100 = 4·1025, not 8·512.5.
    ring = Plan(dp=1, tp=8, cp=4, zero_stage=1, grad_accum=2, engine="megatron")
    assert plan_problem(ring, LLAMA3_70B, workload=workload) == (
        "cp",
        "seq_len 4100 does not split into 8 ring chunks",
    )
    ulysses_ok = ring.model_copy(update={"engine": "deepspeed"})
    assert plan_problem(ulysses_ok, LLAMA3_70B, workload=workload) is None
    four_d = Plan(dp=2, tp=8, pp=2, cp=2, engine="megatron")  # the service's DeepSpeed takes cp at pp 1
    assert four_d.num_gpus == 64
    assert four_d.short() == "megatron:dp2-tp8-pp2-cp2-z0-mb1-ga1-rc:none"


def test_activations_and_model_states_of_a_context_parallel_rank():
    one, two = _estimate(1, dp=8), _estimate(2, dp=4)
    m1, m2 = one.memory_per_gpu_bytes, two.memory_per_gpu_bytes
    assert m2.activations == pytest.approx(m1.activations / 2)  # each rank keeps half the tokens
    assert m2.logits == pytest.approx(m1.logits / 2)
    assert m2.params == m1.params
    # ZeRO-1 shards the optimizer over dp·cp = 8 ranks either way (DeepSpeed's sequence-data group).
    assert m2.optimizer == pytest.approx(m1.optimizer)
    # Transient buffers: Ulysses' all-to-all output, q, k, v, o of 16,384 tokens ((2·8192 + 2·1024)/8
    # elements per token, bf16); ring attention's two K/V receive buffers.
    ulysses, ring = (float(context.buffer_bytes(LLAMA3_70B, 16384.0, 8, 2, e, 2)) for e in (0, 2))
    assert ulysses == 16384 * (2 * 8192 + 2 * 1024) / 8 * 2 == 75_497_472
    assert ring == 2 * 16384 * 2 * 1024 / 8 * 2
    assert float(context.buffer_bytes(LLAMA3_70B, 16384.0, 8, 1, 0, 2)) == 0.0


def test_ulysses_moves_four_activations_per_layer_each_way():
    """Jacobs et al. 2023 §3.2: 4 all-to-alls of N·h/P per layer in forward (MHA), 4 in backward; with
    full recompute the forward runs twice. GQA shrinks k and v to kv/h of q."""
    e = _estimate(2)
    tokens = 32768 / 2
    one = comm.all_gather_time_s(tokens * (2 * 8192 + 2 * 1024) / 8 * 2, 2, 8, 8, H100, 4.0, comm.PRIOR)
    assert e.time_breakdown_s.cp_comm == pytest.approx(16 * 80 * 3 * float(one))  # 80 layers, pp 1
    mha = load_model("llama2-70b").model_copy(update={"num_key_value_heads": 64})
    assert float(context.qkvo_bytes(mha, 100.0, 1, 2)) == 4 * 100 * 8192 * 2


def test_ring_passes_hide_behind_attention_on_long_sequences():
    long, short = _estimate(2, "megatron", 131072), _estimate(2, "megatron", 4096)
    assert long.time_breakdown_s.cp_comm == 0.0  # a 65k-token chunk's attention outlasts its KV pass
    assert short.time_breakdown_s.cp_comm > 0.0
    # Exposed = (cp − 1)·max(0, pass − attention/cp): with no attention to hide behind, the whole pass.
    t = context.ring_exposed_per_layer_s(LLAMA3_70B, 1024.0, 8, 4, 2, 0.0, 1, 8, H100, comm.PRIOR)
    kv_bytes = 1024 * 2 * 8 * 128 / 8 * 2
    assert float(t) == pytest.approx(3 * float(comm.p2p_time_s(kv_bytes, True, H100, comm.PRIOR)))
    assert np.all(context.is_ring(np.array([0, 1, 2])) == [False, True, True])  # deepspeed, fsdp, megatron


def test_ulysses_saves_the_o_proj_input_and_repeated_kv_heads():
    """experiments/tiny-cpu.yaml's model in fp32 (h 128, 2 KV heads of 32): Ulysses' output all-to-all
    makes o_proj's input a tensor of its own (d·h/t); at tp·cp 4 > 2 KV heads each rank's one KV head
    is repeated to cp = 2, so k and v save one head more each (2·d·32). Ring attention and cp 1 add none."""
    from service.spec import load_experiment

    model = load_experiment("experiments/tiny-cpu.yaml").model
    d = 4

    def extra(tp: int, cp: int, engine: int = 0) -> float:
        return float(context.ulysses_saved_bytes_per_token_per_layer(model, tp, cp, engine, d))

    assert extra(1, 2) == d * 128 == 512
    assert extra(2, 2) == d * 128 / 2 + 2 * d * 32 == 512
    assert extra(1, 1) == extra(2, 1) == 0.0
    assert extra(2, 2, engine=2) == 0.0  # ring (megatron)


def test_ulysses_terms_leave_with_the_attention_sub_block():
    """The extra tensors are the attention sub-block's: selective recompute drops them with it; full
    recompute keeps only block inputs, whatever the cp style."""
    deepspeed = _estimate(2, seq=4096, recompute="none").memory_per_gpu_bytes.activations
    megatron = _estimate(2, seq=4096, engine="megatron", recompute="none").memory_per_gpu_bytes
    assert deepspeed > megatron.activations
    # Selective: a Ulysses rank's activations are exactly those of its half of the tokens without cp.
    sel_cp2 = _estimate(2, dp=4, seq=4096, recompute="selective").memory_per_gpu_bytes.activations
    sel_cp1 = _estimate(1, dp=8, seq=4096, recompute="selective").memory_per_gpu_bytes.activations
    assert 2 * sel_cp2 == pytest.approx(sel_cp1, rel=1e-12)
