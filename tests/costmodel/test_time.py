"""Time terms: FLOP counts, roofline matmuls, collectives and the assembled step."""

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import comm, compute, estimate
from service.costmodel.flops import matmul_params, model_flops_per_token
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import ModelParams

H100 = load_gpu("h100-sxm-80gb")
LLAMA13 = load_model("llama2-13b")


def test_model_flops_per_token_palm_convention():
    """6·N_matmul + 12·L·h·s; for Llama-2-7B at 4k: 6·6.61e9 + 12·32·4096·4096 ≈ 4.61e10."""
    model = load_model("llama2-7b")
    n = matmul_params(model)
    assert n == pytest.approx(model.num_params - model.vocab_size * model.hidden_size - 65 * 4096)
    assert float(model_flops_per_token(model, 4096)) == pytest.approx(6 * n + 12 * 32 * 4096 * 4096)
    assert float(model_flops_per_token(model, 4096)) == pytest.approx(4.61e10, rel=0.01)


def test_big_gemm_is_compute_bound_at_catalog_efficiency():
    peak = H100.peak_tflops_bf16 * 1e12
    t = compute.gemm_time_s(
        np.array(8192.0), np.array(8192.0), np.array(8192.0), H100, np.array(peak), np.array(2)
    )
    achieved = 2 * 8192**3 / t / peak
    assert achieved == pytest.approx(H100.gemm_efficiency_max * (8192 / 8256) ** 3)


def test_fused_kernels_read_and_write_each_activation_once():
    """Llama-2-7B (h = 4096, f = 11008, 32 KV heads), tp 1, bf16: eager Hugging Face modules move
    44h + 12(h + kv) + 5f elements per token per block in forward, fused kernels 10h + 2(h + kv) + 3f:
    about a quarter."""
    model, h, f = load_model("llama2-7b"), 4096, 11008
    eager = compute.elementwise_bytes_per_token_forward(model, 1, 2)
    fused = compute.elementwise_bytes_per_token_forward(model, 1, 2, fused=True)
    assert float(eager) == 2 * (44 * h + 12 * 2 * h + 5 * f)
    assert float(fused) == 2 * (10 * h + 2 * 2 * h + 3 * f)
    assert 0.25 < fused / eager < 0.3


def test_the_workload_or_transformer_engine_fuses_the_element_wise_ops():
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1)
    work = Workload(seq_len=4096, global_batch_sequences=16, tokens_to_train=1e9)
    fused = work.model_copy(update={"fused_elementwise": True})
    plan = Plan(dp=8, zero_stage=1, grad_accum=2)

    def compute_s(p, w):
        return estimate(LLAMA13, cluster, p, w, params=ModelParams()).time_breakdown_s.compute

    assert compute_s(plan, fused) < 0.95 * compute_s(plan, work)  # eager HF modules: ~8 % of a step more
    megatron = plan.model_copy(update={"engine": "megatron"})
    assert compute_s(megatron, work) == compute_s(megatron, fused)  # TE layers are fused either way


def test_skinny_gemm_is_memory_bound():
    peak = H100.peak_tflops_bf16 * 1e12
    m, n, k = 8.0, 8192.0, 8192.0
    t = compute.gemm_time_s(np.array(m), np.array(n), np.array(k), H100, np.array(peak), np.array(2))
    assert t == pytest.approx(2 * (m * k + k * n + m * n) / (H100.hbm_bandwidth_gb_per_s * 1e9))


def test_all_reduce_inside_a_node_uses_nvlink():
    one_gb = np.array(1e9)
    t = comm.all_reduce_time_s(one_gb, np.array(8), np.array(1), 8, H100)
    bw = H100.intra_node_bandwidth_gb_per_s * 1e9 * comm.NCCL_BUS_EFFICIENCY
    # NCCL tuning model, one node of 8: ring 2·7 NVLink hops = tree 2·(8 − 1) hops, plus the base latency.
    latency = (comm.NCCL_BASE_LATENCY_US + 14 * H100.intra_node_latency_us) * 1e-6
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / bw + latency)


def test_ring_latency_pays_network_hops_only_between_nodes():
    """512 ranks on 64 nodes of 8: 448 NVLink hops and 63 network hops (NCCL tuning.cc), not 511
    network hops; and one rank per node (dp with tp 8) pays every hop on the network."""
    t = comm.ring_latency_s(np.array(512.0), np.array(1), 8, H100, 1)
    hops = 448 * H100.intra_node_latency_us + 63 * H100.inter_node_latency_us
    assert t == pytest.approx((comm.NCCL_BASE_LATENCY_US + hops) * 1e-6)
    t = comm.ring_latency_s(np.array(64.0), np.array(8), 8, H100, 1)
    assert t == pytest.approx((comm.NCCL_BASE_LATENCY_US + 63 * H100.inter_node_latency_us) * 1e-6)
    # The tree all-reduce grows with log2(nodes), so NCCL's choice (the lower) is the tree at scale.
    tree = comm.tree_latency_s(np.array(512.0), np.array(1), 8, H100)
    assert tree < comm.ring_latency_s(np.array(512.0), np.array(1), 8, H100, 2)


def test_collectives_across_nodes_share_one_nic_per_member():
    # 32 ranks, 8 per node: 8 NICs × 50 GB/s = 400 GB/s, below NVLink's 450.
    bw = comm.group_bus_bandwidth_bytes_per_s(np.array(32), np.array(1), 8, H100)
    assert bw == pytest.approx(8 * 50e9 * comm.NCCL_BUS_EFFICIENCY)
    # dp 4 with tp 8: one member per node, so one NIC.
    bw = comm.group_bus_bandwidth_bytes_per_s(np.array(4), np.array(8), 8, H100)
    assert bw == pytest.approx(50e9 * comm.NCCL_BUS_EFFICIENCY)
    assert comm.all_reduce_time_s(np.array(1e9), np.array(1), np.array(1), 8, H100) == 0.0


CLUSTER = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4, gpus_per_node=8)
WORK = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=2e9)


def _est(**kw):
    # The analytical prior: these tests check the cited formulas, not a fitted parameter set.
    return estimate(LLAMA13, CLUSTER, Plan(**kw), WORK, params=ModelParams())


def test_step_time_is_the_sum_of_its_terms_and_tokens_follow():
    e = _est(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="full")
    assert sum(e.time_breakdown_s.model_dump().values()) == pytest.approx(e.step_time_s)
    assert e.tokens_per_s == pytest.approx(128 * 4096 / e.step_time_s)
    assert e.tokens_per_s_per_gpu == pytest.approx(e.tokens_per_s / 32)
    assert e.hours == pytest.approx(2e9 / e.tokens_per_s / 3600)
    assert e.dollars == pytest.approx(e.hours * 32 * 3.0)


def test_full_recompute_adds_about_a_third_of_the_layer_compute():
    base = _est(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="none")
    full = _est(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="full")
    ratio = full.time_breakdown_s.recompute / base.time_breakdown_s.compute
    assert 0.25 < ratio < 0.34
    assert full.mfu < base.mfu


def test_pipeline_bubble_is_pp_minus_one_slots():
    e = _est(dp=8, pp=4, zero_stage=1, micro_batch=1, grad_accum=16, recompute="full")
    t = e.time_breakdown_s
    per_slot = (t.compute + t.recompute + t.tp_comm + t.pp_comm) / 16
    assert t.bubble == pytest.approx(3 * per_slot, rel=0.02)  # the optimizer step is not in a slot


def test_tensor_parallel_pays_activation_all_reduces():
    tp1 = _est(dp=32, zero_stage=1, micro_batch=1, grad_accum=4, recompute="full")
    tp8 = _est(dp=4, tp=8, zero_stage=1, micro_batch=1, grad_accum=32, recompute="full")
    assert tp1.time_breakdown_s.tp_comm == 0.0
    # 6 all-reduces (4 + 2 recomputed) of s·h·2 bytes per layer per micro-batch over NVLink.
    one = comm.all_reduce_time_s(np.array(4096 * 5120 * 2.0), np.array(8), np.array(1), 8, H100)
    assert tp8.time_breakdown_s.tp_comm == pytest.approx(32 * 6 * 40 * float(one))


def test_mfu_of_a_sensible_13b_plan_is_in_the_published_range():
    """Published DeepSpeed/FSDP runs of 7-13B models on H100 report roughly 35-55 % MFU."""
    e = _est(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="selective")
    assert 0.35 < e.mfu < 0.6


def test_offload_costs_time_and_frees_gpu_memory():
    on = _est(dp=32, zero_stage=3, offload_optimizer=True, micro_batch=1, grad_accum=4, recompute="full")
    off = _est(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="full")
    assert on.time_breakdown_s.offload > 0 and off.time_breakdown_s.offload == 0
    assert on.memory_per_gpu_bytes.optimizer == 0 and on.memory_per_gpu_bytes.cpu_offload > 0
    assert on.step_time_s > off.step_time_s


def test_interleaved_schedule_cuts_the_bubble_by_its_virtual_stages():
    """Narayanan et al. 2021 §2.2.2: v chunks per stage → bubble (pp − 1)/v slots, v× the p2p messages.
    DeepSpeed cannot run it (`Plan` rejects it), so it is scored on a `PlanTable`, as Megatron runs are."""
    from service.costmodel import estimate_table
    from service.spec.plan_table import PlanTable

    def table(v: int) -> PlanTable:
        cols = dict(dp=2, tp=2, pp=8, zero_stage=0, micro_batch=1, grad_accum=32, recompute=2, precision=0)
        cols |= dict(offload_optimizer=False, offload_params=False, sequence_parallel=False, virtual_stages=v)
        return PlanTable.from_columns(**{k: np.asarray([x]) for k, x in cols.items()})

    work = Workload(seq_len=4096, global_batch_sequences=64, tokens_to_train=1e9)
    plain, inter = (estimate_table(LLAMA13, CLUSTER, work, table(v), params=ModelParams()) for v in (1, 5))
    assert inter.pp_comm_s[0] == pytest.approx(5 * plain.pp_comm_s[0])
    per_slot_plain = (plain.compute_s + plain.recompute_s + plain.tp_comm_s + plain.pp_comm_s)[0] / 32
    assert plain.bubble_s[0] == pytest.approx(7 * per_slot_plain, rel=0.02)
    assert inter.bubble_s[0] < plain.bubble_s[0] / 4  # 7/5 slots, each slightly dearer in p2p
    assert inter.step_time_s[0] < plain.step_time_s[0]


def test_pipeline_sends_split_over_tensor_parallel_ranks_where_the_engine_does():
    """A stage boundary moves tokens·h·d bytes per tensor-parallel rank from DeepSpeed's PipelineEngine;
    1/tp of it with sequence parallelism (the rank's sequence chunk) or from Megatron-LM, which also
    all-gathers the chunks over NVLink when SP is off (Narayanan et al. 2021, §4.1). Megatron posts an
    exchange's send and receive together: two transfers per micro-batch. DeepSpeed's blocking sends and
    receives run one after the other: a middle stage of four pays four; with two stages, two."""
    from service.costmodel import estimate_table
    from service.spec.plan_table import ENGINE_CODES, PlanTable

    def pp_comm(engine: str, sp: bool, pp: int = 4) -> float:
        cols = dict(dp=1, tp=8, pp=pp, zero_stage=1, micro_batch=1, grad_accum=16, recompute=2, precision=0)
        cols |= dict(offload_optimizer=False, offload_params=False, sequence_parallel=sp)
        cols |= dict(engine=ENGINE_CODES.index(engine))
        table = PlanTable.from_columns(**{k: np.asarray([x]) for k, x in cols.items()})
        return float(estimate_table(LLAMA13, CLUSTER, work, table, params=ModelParams()).pp_comm_s[0])

    work = Workload(seq_len=4096, global_batch_sequences=16, tokens_to_train=1e9)
    whole = 4096 * LLAMA13.hidden_size * 2
    send = comm.p2p_time_s(whole, True, H100)  # tp 8 fills the node: every stage hop crosses it
    chunk = comm.p2p_time_s(whole / 8, True, H100)
    gather = comm.all_gather_time_s(whole, 8, 1, 8, H100)
    assert pp_comm("deepspeed", False) == pytest.approx(16 * 4 * float(send))
    assert pp_comm("deepspeed", True) == pytest.approx(16 * 4 * float(chunk))
    assert pp_comm("deepspeed", False, pp=2) == pytest.approx(16 * 2 * float(send))
    assert pp_comm("megatron", True) == pytest.approx(16 * 2 * float(chunk))
    assert pp_comm("megatron", False) == pytest.approx(16 * 2 * float(chunk + gather))
    assert pp_comm("megatron", False, pp=2) == pp_comm("megatron", False)
    assert pp_comm("fsdp", False) == pytest.approx(16 * 2 * float(send))
    assert pp_comm("megatron", False) < pp_comm("deepspeed", False) / 3


def test_deepspeed_plans_cannot_interleave():
    with pytest.raises(ValueError, match="virtual_stages: deepspeed has no interleaved pipeline schedule"):
        Plan(dp=4, pp=8, grad_accum=8, virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages > 1 needs pp > 1"):
        Plan(dp=32, virtual_stages=2)
    assert Plan(dp=4, pp=8).short() == "dp4-tp1-pp8-z0-mb1-ga1-rc:none"  # plain 1F1B keeps its label
    # torchtitan interleaves FSDP pipelines (torch.distributed.pipelining's ScheduleInterleaved1F1B).
    assert (
        Plan(dp=4, pp=8, zero_stage=3, virtual_stages=2, engine="fsdp")
        .short()
        .startswith("fsdp:dp4-tp1-pp8v2")
    )


def test_fsdp_issues_one_collective_per_block_where_deepspeed_issues_one_per_bucket():
    """A 7B model with ZeRO-2 on 512 H100s: DeepSpeed all-reduces each gradient bucket (~8 per block:
    costmodel/buckets.py), twice a reduce-scatter's bytes; FSDP's SHARD_GRAD_OP reduce-scatters one flat
    parameter per block (32) and prefetches the next forward's gathers."""
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=64)
    work = Workload(seq_len=2048, global_batch_sequences=512 * 4, tokens_to_train=1e9)
    llama7 = load_model("llama2-7b")
    ds, fsdp = (
        estimate(
            llama7, cluster, Plan(dp=512, zero_stage=2, micro_batch=4, engine=e), work, params=ModelParams()
        )
        for e in ("deepspeed", "fsdp")
    )
    assert fsdp.time_breakdown_s.dp_comm < 0.8 * ds.time_breakdown_s.dp_comm
    assert fsdp.time_breakdown_s.compute == ds.time_breakdown_s.compute
    assert fsdp.plan.short().startswith("fsdp:dp512")


def test_each_engine_has_its_own_rules():
    assert Plan(dp=2, tp=8, pp=4, zero_stage=1, virtual_stages=2, engine="megatron").num_gpus == 64
    with pytest.raises(ValueError, match="zero_stage: FSDP shards gradients with optimizer states"):
        Plan(dp=8, zero_stage=1, engine="fsdp")
    with pytest.raises(
        ValueError, match=r"zero_stage: Megatron-FSDP \(zero_stage 2-3\) is priced without a pipeline"
    ):
        Plan(dp=2, pp=4, zero_stage=3, engine="megatron")
    assert Plan(dp=8, tp=8, zero_stage=3, engine="megatron").num_gpus == 64  # Megatron-FSDP with TP
    assert Plan(dp=2, tp=8, pp=4, zero_stage=1).num_gpus == 64  # Megatron-DeepSpeed's 3D layout
    pipeline = r"zero_stage: DeepSpeed's PipelineEngine .*; with pp > 1 deepspeed supports zero_stage 0 or 1"
    with pytest.raises(ValueError, match=pipeline):
        Plan(dp=2, tp=8, pp=4, zero_stage=2)
    with pytest.raises(ValueError, match=r"offload_params: FSDP's CPUOffload .*; fsdp offloads optimizer"):
        Plan(dp=8, zero_stage=3, offload_optimizer=True, engine="fsdp")
    with pytest.raises(ValueError, match=r"offload_optimizer: Megatron-LM does not .*; megatron does not"):
        Plan(dp=8, zero_stage=1, offload_optimizer=True, engine="megatron")


def test_overlapped_collective_pays_its_contention_on_the_compute_it_hides_behind():
    """exposed = max(0, comm − compute) + κ·min(comm, compute): NCCL's CTAs hold SMs while they run."""
    # 0.3 s of all-gathers behind 1.0 s of GEMMs at κ = 0.18 (24 CTAs / 132 SMs): 0.18 × 0.3 = 0.054 s.
    assert comm.overlapped_exposed_s(np.array(0.3), np.array(1.0), 0.18) == pytest.approx(0.054)
    # 1.5 s behind 1.0 s: the 0.5 s that outlasts the compute, plus 0.18 × 1.0 s during it = 0.68 s.
    assert comm.overlapped_exposed_s(np.array(1.5), np.array(1.0), 0.18) == pytest.approx(0.68)
    assert comm.overlapped_exposed_s(np.array(0.3), np.array(1.0), 0.0) == 0.0  # the old perfect overlap


def test_zero3_gathers_hidden_behind_compute_still_cost_their_contention():
    """Llama-2-13B, ZeRO-3 over 32 H100s (4 nodes of 8), 4 micro-batches of 4096 tokens, prior κ = 0.18.

    Per micro-batch ZeRO-3 moves Ψ = 13.0e9 bf16 params three times (gather fwd, gather bwd, reduce-scatter
    grads): 3 × 31/32 × 2Ψ bytes over 8 NICs × 50 GB/s × 0.8 = 320 GB/s ≈ 0.236 s, plus NCCL's ring
    latency per module gather (40 blocks × 7 matmuls × 3). That is well under the ~0.5 s of fwd + bwd, so
    all of it is hidden and the step pays 4 × 0.18 × comm ≈ 0.17 s (before: 0).
    """
    plan = dict(dp=32, zero_stage=3, micro_batch=1, grad_accum=4, recompute="none")
    e = _est(**plan)
    psi = 2 * LLAMA13.num_params  # bf16 parameter (and gradient) bytes, unsharded
    bandwidth = 3 * 31 / 32 * psi / (8 * 50e9 * comm.NCCL_BUS_EFFICIENCY)
    latency = 3 * 40 * 7 * float(comm.ring_latency_s(np.array(32.0), np.array(1), 8, H100, 1))
    per_micro_batch = bandwidth + latency
    assert bandwidth == pytest.approx(0.236, rel=0.01)
    assert per_micro_batch < e.time_breakdown_s.compute / 4  # hidden: no part outlasts the compute
    assert e.time_breakdown_s.dp_comm == pytest.approx(4 * 0.18 * per_micro_batch, rel=1e-6)
    perfect = estimate(
        LLAMA13, CLUSTER, Plan(**plan), WORK, params=ModelParams().with_values({"overlap_contention": 0.0})
    )
    assert perfect.time_breakdown_s.dp_comm == 0.0


def test_deepspeed_gradient_buckets_are_packed_tensor_by_tensor():
    """DeepSpeed's IPG bucket flushes when the next gradient would overflow it, so a tensor as large as
    the bucket goes alone: the 4-layer tiny proxy (h 128, bucket h² = 16,384) issues 30 reductions per
    step (counted on DeepSpeed 0.19.8 at dp 2), where Ψ / bucket says 53."""
    from service.costmodel.buckets import gradient_reduce_calls, greedy_calls
    from service.spec.model import ModelSpec
    from service.spec.zero import ZeroKnobs

    tiny = ModelSpec(
        name="tiny", num_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
        ffn_hidden_size=344, vocab_size=512, mlp="swiglu", tie_word_embeddings=False,
    )  # fmt: skip
    bucket = ZeroKnobs.for_model(tiny).reduce_bucket_elements
    assert gradient_reduce_calls(tiny, [1], [1], bucket).tolist() == [30.0]
    assert greedy_calls([10, 10, 10], 10) == 3 and greedy_calls([4, 4, 4], 10) == 2  # 4+4 | 4
    assert greedy_calls([25, 1, 1], 10) == 2 and greedy_calls([], 10) == 0
    # tp shards the matrices, so more of them share a bucket; pp keeps fewer blocks per rank
    assert (
        gradient_reduce_calls(tiny, [2], [1], bucket)[0] < 30
        and gradient_reduce_calls(tiny, [1], [2], bucket)[0] < 30
    )


def test_an_uneven_pipeline_runs_at_the_pace_of_its_busiest_stage():
    """Llama-2-13B's 40 layers on 16 stages: the first 8 hold 3 blocks, the rest 2 (memory.stage_layers),
    the last 2 and the LM head. A 13B block outweighs its head, so the first stages set the pace and a
    larger vocabulary costs the pipeline (almost) nothing until the head outweighs the block the last
    stage lacks; on an even split (48 layers, 3 blocks everywhere) the head adds to the pace in full."""
    model = load_model("llama2-13b")
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    workload = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=1e9)
    plan = Plan(dp=2, pp=16, zero_stage=1, micro_batch=1, grad_accum=64)

    def step_s(layers: int, vocab: int) -> float:
        shaped = model.model_copy(update={"num_layers": layers, "vocab_size": vocab})
        return estimate(shaped, cluster, plan, workload).step_time_s

    # only the optimizer step and the gradient traffic of the larger embedding move (< 0.1 %)
    assert step_s(40, 48_000) == pytest.approx(step_s(40, 32_000), rel=1e-3)
    assert step_s(48, 48_000) > 1.05 * step_s(48, 32_000)
    assert step_s(40, 200_000) > 1.5 * step_s(40, 32_000)  # the head now outweighs a block
    uneven, even = (
        estimate(model, cluster, plan, workload),
        estimate(model.model_copy(update={"num_layers": 48}), cluster, plan, workload),
    )
    assert uneven.step_time_s < even.step_time_s
    assert uneven.memory_per_gpu_bytes == even.memory_per_gpu_bytes  # the first stage, the busiest
    halved = estimate(model, cluster, plan.model_copy(update={"pp": 8, "dp": 4, "grad_accum": 32}), workload)
    assert halved.step_time_s < uneven.step_time_s  # 5 blocks per stage and a shorter bubble


def test_megatron_hides_backward_tensor_parallel_collectives_behind_weight_gradients():
    """Megatron-LM's column-parallel layers all-reduce (SP: reduce-scatter) their input gradient while
    they compute their weight gradient; DeepSpeed's AutoTP and our proxy's layers do not overlap."""
    model = load_model("gpt3-175b")  # h 12,288: the weight-gradient GEMMs outlast the collectives
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1)
    workload = Workload(seq_len=2048, global_batch_sequences=8, tokens_to_train=1e9)
    prior = ModelParams()

    def tp_comm(engine: str, sp: bool, recompute: str = "selective") -> float:
        plan = Plan(
            tp=8, micro_batch=1, grad_accum=8, engine=engine, sequence_parallel=sp, recompute=recompute
        )
        return estimate(model, cluster, plan, workload, params=prior).time_breakdown_s.tp_comm

    for sp in (False, True):
        deepspeed, megatron = tp_comm("deepspeed", sp), tp_comm("megatron", sp)
        # Forward: 2 of the 4 all-reduce volumes stay exposed. Backward: 2 volumes hidden behind the GEMMs
        # (their contention is paid); with SP the output-gradient all-gathers (1 volume) stay exposed.
        exposed = (2 + sp) / 4 * deepspeed
        hidden = 2 / 4 * deepspeed
        kappa = prior["overlap_contention"]
        assert megatron == pytest.approx(exposed + kappa * hidden, rel=1e-6), sp
    # Full recompute re-runs the forward: its 2 collectives are exposed in both engines.
    assert tp_comm("deepspeed", False, "full") - tp_comm("megatron", False, "full") == pytest.approx(
        tp_comm("deepspeed", False) - tp_comm("megatron", False), rel=1e-6
    )
    # A narrower model (h 5,120 over tp 8): the collectives outlast the GEMMs and the excess shows.
    narrow = load_model("llama2-13b")
    plan = Plan(tp=8, micro_batch=1, grad_accum=8, recompute="selective")
    ds = estimate(narrow, cluster, plan, workload, params=prior).time_breakdown_s.tp_comm
    mg = estimate(narrow, cluster, plan.model_copy(update={"engine": "megatron"}), workload, params=prior)
    assert 0.5 * ds + prior["overlap_contention"] * 0.5 * ds < mg.time_breakdown_s.tp_comm < ds


def test_a_fits_tokens_per_s_is_the_estimate_tables_bitwise():
    """`tokens_per_s_per_gpu` (what a calibration fit evaluates) is `estimate_table`'s column, every
    plan of the seed's space on three engines, to the last bit."""
    from service.costmodel import estimate_table
    from service.costmodel.estimate import tokens_per_s_per_gpu
    from service.plans import enumerate_plans

    work = Workload(seq_len=4096, global_batch_sequences=256, tokens_to_train=1e9)
    plans = enumerate_plans(LLAMA13, CLUSTER, work, engines=("deepspeed", "megatron", "fsdp")).plans
    params = ModelParams().with_values({"gemm_efficiency_scale": 0.8, "step_overhead_s": 0.3})
    fast = tokens_per_s_per_gpu(LLAMA13, CLUSTER, work, plans, params)
    assert len(plans) > 100
    np.testing.assert_array_equal(
        fast, estimate_table(LLAMA13, CLUSTER, work, plans, 0.0, params).tokens_per_s_per_gpu
    )
