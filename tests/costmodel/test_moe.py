"""MoE terms of the cost model (service/costmodel/moe.py), checked against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_model
from service.costmodel import comm, expert_exchange, moe
from service.costmodel.estimate import estimate
from service.costmodel.flops import matmul_params, model_flops_per_token
from service.spec import ClusterSpec, ModelSpec, Plan, Workload, plan_problem
from service.spec.moe_spec import MoESpec
from service.spec.plan_table import PlanTable

GIB = 2**30
# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json).
MIXTRAL = ModelSpec(
    name="mixtral-8x7b", num_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    ffn_hidden_size=14336, vocab_size=32000,
    moe=MoESpec(num_experts=8, experts_per_token=2, expert_ffn_hidden_size=14336),
)  # fmt: skip
# 64 fine-grained experts: EP can outgrow a node.
FINE = MIXTRAL.model_copy(
    update={"moe": MoESpec(num_experts=64, experts_per_token=8, expert_ffn_hidden_size=1792)}
)
H100 = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
WORK = Workload(seq_len=4096, global_batch_sequences=256, tokens_to_train=1e12)


def test_flops_per_token_count_the_active_experts_only():
    per_expert = 3 * 4096 * 14336
    dense = MIXTRAL.dense_view()
    attention_and_router = 32 * (dense.attention_params_per_layer + dense.mlp_params_per_layer)
    expected = attention_and_router + 32 * 2 * per_expert + 32000 * 4096
    assert matmul_params(MIXTRAL) == expected
    # 6·N_active + 12·L·h·s: the active matrices are 12.75B of Mixtral's 12.9B active parameters.
    assert model_flops_per_token(MIXTRAL, 4096) == pytest.approx(6 * expected + 12 * 32 * 4096 * 4096)
    assert expected / 1e9 == pytest.approx(12.75, abs=0.01)


def test_expert_states_are_sharded_by_ep_and_by_zero_over_the_expert_data_parallel_group():
    plan = Plan(dp=64, ep=8, engine="megatron", zero_stage=1, micro_batch=1, grad_accum=4, recompute="full")
    e = estimate(MIXTRAL, H100, plan, WORK)
    psi = 32 * 8 * 3 * 4096 * 14336 / 8  # the experts of 32 blocks over 8 EP ranks
    edp = 64 // 8
    assert e.memory_per_gpu_bytes.experts == pytest.approx(2 * psi + 2 * psi + 12 * psi / edp)
    # The dense part (attention, router, embeddings) shards its optimizer over all 64 ranks.
    assert e.memory_per_gpu_bytes.params == pytest.approx(
        2 * psi + 2 * MIXTRAL.dense_view().num_params, rel=1e-3
    )


def test_expert_data_parallel_and_ep_group_follow_the_folded_layout():
    plans = [
        Plan(dp=32, tp=2, ep=8, engine="megatron", zero_stage=1, sequence_parallel=True),
        Plan(dp=32, tp=2, ep=8, expert_tp=2, engine="megatron", zero_stage=1, sequence_parallel=True),
        Plan(dp=64, ep=4, engine="deepspeed", zero_stage=2),
    ]
    table = PlanTable.from_plans(plans)
    assert moe.expert_data_parallel(table).tolist() == [8, 4, 16]
    assert moe.ep_stride(table).tolist() == [1, 2, 1]
    assert moe.gather_group(table).tolist() == [1, 2, 1]  # DeepSpeed regathers over its TP ranks (tp 1 here)


def test_all_to_all_crosses_the_network_once_the_ep_group_outgrows_a_node():
    gpu = H100.gpu
    links = comm.Links()
    one_gib = 2.0**30  # large enough that NCCL's latency is lost in the bandwidth term
    inside = expert_exchange.all_to_all_time_s(one_gib, 8, 1, 8, gpu, links, 0.8)
    across = expert_exchange.all_to_all_time_s(one_gib, 16, 1, 8, gpu, links, 0.8)
    # Inside a node: 7/8 of the message over NVLink; across two: half of it through the rank's NIC.
    nvlink = gpu.intra_node_bandwidth_gb_per_s * 1e9 * links.intra_efficiency
    nic = gpu.inter_node_bandwidth_gb_per_s * 1e9 * 0.8
    assert inside == pytest.approx(one_gib * 7 / 8 / nvlink, rel=0.02)
    assert across == pytest.approx(one_gib * 8 / 16 / nic, rel=0.02)
    assert across > 5 * inside
    within, spanning = (
        estimate(FINE, H100, Plan(dp=64, ep=ep, engine="megatron", zero_stage=1, grad_accum=4), WORK)
        for ep in (8, 16)
    )
    assert spanning.time_breakdown_s.ep_comm > 3 * within.time_breakdown_s.ep_comm


def test_load_imbalance_slows_dropless_plans_and_capacity_pads_to_its_factor():
    plan = Plan(dp=64, ep=8, engine="megatron", zero_stage=1, grad_accum=4, recompute="full")
    balanced, skewed = (
        estimate(MIXTRAL, H100, plan, WORK.model_copy(update={"moe_load_imbalance": x})) for x in (1.0, 2.0)
    )
    assert skewed.tokens_per_s < 0.9 * balanced.tokens_per_s
    # Twice the bytes through the busiest rank (NCCL's per-call latency does not grow with them).
    ratio = skewed.time_breakdown_s.ep_comm / balanced.time_breakdown_s.ep_comm
    assert 1.6 < ratio < 2.0
    capacity = MIXTRAL.model_copy(
        update={"moe": MIXTRAL.moe.model_copy(update={"router": "capacity", "capacity_factor": 1.0})}
    )
    padded = estimate(capacity, H100, plan, WORK.model_copy(update={"moe_load_imbalance": 2.0}))
    assert padded.tokens_per_s == pytest.approx(balanced.tokens_per_s, rel=1e-9)  # cf 1.0 = balanced


def test_load_factor_is_the_imbalance_or_the_capacity_factor():
    table = PlanTable.from_plans([Plan(dp=64, ep=ep, engine="megatron", zero_stage=1) for ep in (64, 4)])
    assert moe.load_factor(FINE, table, 1.5).tolist() == [1.5, 1.5]
    capacity = FINE.model_copy(
        update={"moe": FINE.moe.model_copy(update={"router": "capacity", "capacity_factor": 1.25})}
    )
    assert moe.load_factor(capacity, table, 1.5).tolist() == [1.25, 1.25]


def test_without_expert_parallelism_only_a_padding_layer_waits_for_the_busiest_expert():
    """ep 1: every expert is local, so a grouped-GEMM layer runs its tokens' k copies whatever the skew;
    DeepSpeed's dropless layer pads each expert to the busiest one's count, and capacity routers pad to
    their factor."""
    engines = ("megatron", "fsdp", "deepspeed")
    table = PlanTable.from_plans([Plan(dp=64, engine=e, zero_stage=0) for e in engines])
    assert moe.load_factor(FINE, table, 1.5).tolist() == [1.0, 1.0, 1.5]
    capacity = FINE.model_copy(
        update={"moe": FINE.moe.model_copy(update={"router": "capacity", "capacity_factor": 1.25})}
    )
    assert moe.load_factor(capacity, table, 1.5).tolist() == [1.25, 1.25, 1.25]
    plan = Plan(dp=64, engine="megatron", zero_stage=1, grad_accum=4, recompute="full")
    balanced, skewed = (
        estimate(MIXTRAL, H100, plan, WORK.model_copy(update={"moe_load_imbalance": x})) for x in (1.0, 3.0)
    )
    assert skewed.tokens_per_s == balanced.tokens_per_s
    assert skewed.memory_per_gpu_bytes.total == balanced.memory_per_gpu_bytes.total


def test_the_expert_gradient_sync_overlaps_as_the_dense_one_does():
    """The expert slice's reduction waits for the last micro-batch's backward (ZeRO 0-1: once per step,
    so more micro-batches do not hide it), and ZeRO-2 reduces every micro-batch, as the dense slice."""

    def dp_comm_s(zero: int, ga: int) -> float:
        plan = Plan(dp=64, ep=8, engine="megatron", zero_stage=zero, grad_accum=ga, comm_overlap=True)
        work = WORK.model_copy(update={"global_batch_sequences": 64 * ga})
        return estimate(MIXTRAL, H100, plan, work).time_breakdown_s.dp_comm

    assert dp_comm_s(1, 8) == pytest.approx(dp_comm_s(1, 1), rel=1e-9)
    assert dp_comm_s(0, 8) == pytest.approx(dp_comm_s(0, 1), rel=1e-9)
    assert dp_comm_s(2, 8) > 1.5 * dp_comm_s(2, 1)  # eight reductions, each mostly behind its backward


def test_dense_model_is_unchanged_by_the_moe_terms():
    dense = MIXTRAL.model_copy(update={"moe": None})
    e = estimate(dense, H100, Plan(dp=64, zero_stage=1, grad_accum=4), WORK)
    assert e.memory_per_gpu_bytes.experts == 0 and e.time_breakdown_s.ep_comm == 0


def test_full_recompute_keeps_no_expert_activations_but_replays_the_all_to_all():
    plan = Plan(dp=64, ep=8, engine="megatron", zero_stage=1, grad_accum=4)
    none, full = (
        estimate(MIXTRAL, H100, plan.model_copy(update={"recompute": r}), WORK) for r in ("none", "full")
    )
    assert full.memory_per_gpu_bytes.activations < 0.2 * none.memory_per_gpu_bytes.activations
    assert full.time_breakdown_s.ep_comm == pytest.approx(1.5 * none.time_breakdown_s.ep_comm)


CAPACITY = MIXTRAL.model_copy(
    update={"moe": MIXTRAL.moe.model_copy(update={"router": "capacity", "capacity_factor": 1.25})}
)
DENSE = MIXTRAL.model_copy(update={"moe": None})
MEGATRON = dict(engine="megatron", zero_stage=1)


@pytest.mark.parametrize(
    ("model", "plan", "field", "fragment"),
    [
        (DENSE, dict(dp=8, ep=8, **MEGATRON), "ep", "no routed experts"),
        (MIXTRAL, dict(dp=8, ep=3, **MEGATRON), "ep", "ep 3 does not divide num_experts 8"),
        (MIXTRAL, dict(dp=8, ep=8, engine="deepspeed", zero_stage=3), "zero_stage",
         "with MoE blocks deepspeed supports zero_stage 0, 1 or 2"),
        (CAPACITY, dict(dp=8, ep=8, engine="fsdp", zero_stage=3), "engine", "fsdp has no capacity router"),
        (MIXTRAL, dict(dp=4, tp=2, ep=8, expert_tp=2, sequence_parallel=True, **MEGATRON), "ep",
         "ep·expert_tp = 16 does not divide the 8 ranks"),
        (MIXTRAL, dict(dp=4, tp=2, ep=4, expert_tp=2, engine="fsdp", zero_stage=3), "expert_tp",
         "fsdp splits experts never"),
    ],
)  # fmt: skip
def test_bad_expert_layouts_name_the_field(model, plan, field, fragment):
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1)
    problem = plan_problem(Plan.model_construct(**{**Plan().model_dump(), **plan}), model, cluster)
    assert problem is not None and problem[0] == field and fragment in problem[1], problem


def test_fp8_keeps_the_grouped_gemm_inputs_in_one_byte():
    """Transformer Engine's grouped GEMMs in FP8 save fc1's input (the permuted token, h) and fc2's (f)
    cast to 1 byte; the fused SwiGLU's fc1 output (2f) and the combine's inputs stay in bf16."""
    from service.costmodel.moe import activation_bytes_per_token_per_moe_layer

    model = load_model("qwen3-30b-a3b")
    moe = model.moe
    assert moe is not None
    plans = PlanTable.from_plans(
        [
            Plan(dp=8, ep=8, micro_batch=1, grad_accum=1, zero_stage=1, engine="megatron", precision=p)
            for p in ("bf16", "fp8")
        ]
    )
    bf16, fp8 = activation_bytes_per_token_per_moe_layer(model, plans, 2.0, 1.0)
    k, f, h = moe.experts_per_token, moe.expert_ffn_hidden_size, model.hidden_size
    assert bf16 - fp8 == pytest.approx(k * (f + h))  # one byte saved per element of both inputs
    assert fp8 > k * (2 * 2 * f + f + h)  # the fc1 output stays in bf16


def test_fp8_casts_every_routed_copy_so_it_buys_small_experts_little():
    """Each expert GEMM's input is cast per routed copy (k per token): h for fc1, f for fc2, 3 bytes an
    element under delayed scaling (Megatron), 5 under dynamic (torchtitan's torchao); bf16 casts
    nothing. The SwiGLU between them reads 2f and writes f per copy, in bf16. With expert_tp, a rank
    computes its expert-TP group's copies, each f/expert_tp wide. All of it is part of `forward_s`."""
    model = load_model("qwen3-30b-a3b")
    moe_spec = model.moe
    assert moe_spec is not None
    gpu = H100.gpu
    plans = [
        Plan(dp=8, ep=8, micro_batch=1, grad_accum=1, zero_stage=zero, engine=engine, precision=precision)
        for engine, zero, precision in (("megatron", 1, "bf16"), ("megatron", 1, "fp8"), ("fsdp", 2, "fp8"))
    ]
    plans.append(
        Plan(dp=4, tp=2, ep=4, expert_tp=2, micro_batch=1, grad_accum=1, zero_stage=1, engine="megatron",
             sequence_parallel=True, precision="fp8")
    )  # fmt: skip
    table = PlanTable.from_plans(plans)
    casts = moe.fp8_cast_time_forward_s(model, table, 4096, gpu, 1.0)
    k, f, h = moe_spec.experts_per_token, moe_spec.expert_ffn_hidden_size, model.hidden_size
    hbm = gpu.hbm_bandwidth_gb_per_s * 1e9
    assert casts[0] == 0.0
    assert casts[1] == pytest.approx(4096 * k * (h + f) * 3 / hbm)
    assert casts[2] == pytest.approx(4096 * k * (h + f) * 5 / hbm)
    # tp 2: a rank dispatches half the tokens; its expert-TP group of 2 gathers them back
    assert casts[3] == pytest.approx(2048 * 2 * k * (h + f / 2) * 3 / hbm)
    fc2 = moe.fp8_cast_time_forward_s(model, table, 4096, gpu, 1.0, fc1=False)
    assert fc2[1] == pytest.approx(4096 * k * f * 3 / hbm)
    d = np.array([2.0, 1.0, 1.0, 1.0])
    act = moe.activation_time_forward_s(model, table, 4096, gpu, 2.0, 1.0)
    assert act[0] == pytest.approx(4096 * k * (2 + 1) * 2 * f / hbm)
    assert act[3] == pytest.approx(act[0] / 2)  # tp 2 halves the tokens; expert_tp 2 gathers them, f/2 wide
    peak = gpu.peak_tflops_bf16 * 1e12 * np.array([1.0, 2.0, 2.0, 2.0])
    experts = moe.forward_s(model, table, 4096, 1, gpu, peak, d, 1.0)
    gemms = moe.expert_gemm_time_forward_s(model, table, 4096, gpu, peak, d, 1.0)
    router = moe.router_and_permute_time_forward_s(model, table, 4096, gpu, peak, 2.0, 1.0)
    assert experts == pytest.approx(gemms + router + act + casts)
    # the fitted factor on non-matmul traffic scales the passes over HBM, not the GEMMs
    scaled = moe.forward_s(model, table, 4096, 1, gpu, peak, d, 1.0, elementwise_scale=0.5)
    assert experts - scaled == pytest.approx(
        0.5 * (experts - gemms - router) + 0.5 * (router - _logits(model, table, gpu, peak))
    )


def _logits(model: ModelSpec, table: PlanTable, gpu, peak) -> np.ndarray:
    """The router's logits GEMM alone (the part of `router_and_permute_time_forward_s` that is a GEMM)."""
    from service.costmodel import compute

    assert model.moe is not None
    t = moe.tokens_dispatched(table, 4096)
    return np.asarray(compute.gemm_time_s(t, model.moe.num_experts, model.hidden_size, gpu, peak, 2.0))


def test_optimizer_offload_steps_the_experts_on_the_cpu_and_moves_their_gradients():
    """ZeRO-2 with the optimizer offloaded: CPU Adam steps the experts' shard too (a MoE model's largest
    slice), and their gradient partition leaves the GPU for the host's fp32 buffer, as the dense one does
    (offload.py, step_memory.model_states)."""
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    plans = [
        Plan(dp=32, ep=8, zero_stage=2, offload_optimizer=off, micro_batch=1, grad_accum=8, recompute="full")
        for off in (False, True)
    ]
    on_gpu, offloaded = (estimate(MIXTRAL, cluster, p, WORK) for p in plans)
    edp = 32 // 8
    shard = MIXTRAL.expert_params_per_moe_layer * MIXTRAL.num_moe_layers / 8 / edp  # one rank's expert shard
    cpu_adam_s = shard / (cluster.gpu.cpu_adam_gparams_per_s * 1e9)
    assert offloaded.time_breakdown_s.offload > cpu_adam_s > 1.0  # 1.41 G expert params at 1 G/s
    assert offloaded.step_time_s > on_gpu.step_time_s + cpu_adam_s - 0.1  # the GPU step it saves is small
    expert_grads = 2 * shard  # bf16, ZeRO-2 shards them over the expert-data-parallel group
    assert on_gpu.memory_per_gpu_bytes.grads >= expert_grads
    assert offloaded.memory_per_gpu_bytes.grads == 0
    # the host holds the experts' fp32 master, moments and gradient partition: 16 bytes per parameter
    assert offloaded.memory_per_gpu_bytes.cpu_offload >= 16 * shard


def test_fp8_keeps_copies_of_the_expert_weights_too():
    """Transformer Engine caches an FP8 copy and transpose of every weight its FP8 GEMMs read, the
    grouped expert GEMMs' included: 2 bytes per parameter the rank holds, the experts' as the dense
    blocks' (16 blocks on this stage, one of each block's 8 experts per rank at ep 8)."""
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    work = Workload(seq_len=4096, global_batch_sequences=128, tokens_to_train=1e9)
    layout = dict(engine="megatron", dp=16, pp=2, ep=8, zero_stage=1, micro_batch=1, grad_accum=8)
    layout["recompute"] = "full"
    bf16, fp8 = (estimate(MIXTRAL, cluster, Plan(**layout, precision=p), work) for p in ("bf16", "fp8"))
    experts_on_stage = MIXTRAL.expert_params_per_moe_layer * (32 // 2) / 8
    dense = MIXTRAL.dense_view()
    dense_on_stage = (dense.attention_params_per_layer + dense.mlp_params_per_layer) * (32 // 2)
    extra = fp8.memory_per_gpu_bytes.buffers - bf16.memory_per_gpu_bytes.buffers
    assert extra == pytest.approx(2 * (experts_on_stage + dense_on_stage), rel=0.01)


def test_a_stage_of_dense_blocks_saves_what_their_own_mlp_width_makes():
    """DeepSeek-V3's first three blocks are dense (MLP 18,432 wide), the rest MoE blocks whose shared
    expert and router the dense view prices at a mean width of a few thousand. A first pipeline stage
    holding three dense blocks and one MoE block saves, per micro-batch in flight, those four blocks'
    own activations (the mean width left it 2 GiB short here)."""
    from service.costmodel import memory as mem
    from service.costmodel.step_memory import stage_memory_terms

    model = load_model("deepseek-v3")
    work = Workload(seq_len=4096, global_batch_sequences=256, tokens_to_train=1e9)
    plan = Plan(engine="megatron", dp=4, tp=8, pp=16, ep=32, zero_stage=1, micro_batch=1, grad_accum=64,
                sequence_parallel=True)  # fmt: skip
    table = PlanTable.from_plans([plan])
    first_moe, _, _ = moe.moe_blocks_per_stage(model, table.pp, table.virtual_stages)
    assert mem.stage_layers(61, 16, 1)[0] == 4 and first_moe[0] == 1

    def saved(ffn: int) -> float:
        view = model.dense_view().model_copy(update={"ffn_hidden_size": ffn})
        args = (view, 8, np.array(True), np.array(0), 2, 4096, True, np.array(0), np.array(True))
        return float(mem.activation_bytes_per_token_per_layer(*args))

    shared = round(model.shared_params_per_moe_layer / (3 * model.hidden_size))
    in_flight = mem.micro_batches_in_flight(16, 64, 1)
    first, _ = stage_memory_terms(model, work, table)
    routed = moe.stage_memory(
        model, table, 4096, first_moe, in_flight, 2.0, moe.load_factor(model, table, 1.5),
        mem.state_bytes_per_param(table.precision, table.zero_stage),
    ).saved  # fmt: skip
    tokens = 4096
    expected = tokens * (3 * saved(18432) + saved(shared)) * in_flight + routed
    assert float(first.activations[0]) == pytest.approx(float(expected[0]), rel=1e-6)
    mean = tokens * 4 * saved(model.dense_view().ffn_hidden_size) * in_flight + routed
    assert float(first.activations[0] - mean[0]) > 1.5 * GIB


def test_the_expert_and_dense_reductions_share_one_backward():
    """ZeRO-2 reduces every micro-batch behind its backward; the expert buckets go on the same stream
    after the dense ones. Backward 1 s, dense reduce 0.7 s, expert reduce 0.6 s: each alone hides, but in
    series 0.3 s outlasts the backward (each micro-batch), which counting them apart never showed."""
    from service.costmodel.data_parallel import ZeroTraffic, exposed_comm_s, in_series

    table = PlanTable.from_plans([Plan(dp=8, ep=8, zero_stage=2, grad_accum=4)])
    one, zero = np.array([1.0]), np.zeros(1)

    def reducing(seconds: float) -> ZeroTraffic:
        t = np.array([seconds])
        return ZeroTraffic(one, np.array([False]), t, t, zero, zero, zero, zero, zero, zero)

    dense, experts = reducing(0.7), reducing(0.6)
    fwd, bwd = np.array([0.5]), np.array([1.0])
    apart = exposed_comm_s(dense, table, fwd, bwd) + exposed_comm_s(experts, table, fwd, bwd)
    together = exposed_comm_s(in_series(dense, experts), table, fwd, bwd)
    assert float(apart[0]) == 0.0
    assert float(together[0]) == pytest.approx(4 * 0.3)


def test_the_all_to_all_overlap_needs_a_second_micro_batch_to_pair_with():
    """Megatron's 1F1B all-to-all overlap runs one micro-batch's forward beside another's backward: at
    grad_accum 1 there is none, so nothing hides; at 4, the first forward and last backward stay exposed."""
    qwen = load_model("qwen3-30b-a3b")
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)

    def ep_s(grad_accum: int, overlap: bool) -> float:
        plan = Plan(engine="megatron", dp=64, ep=16, zero_stage=1, micro_batch=8 // grad_accum,
                    grad_accum=grad_accum, recompute="full", ep_comm_overlap=overlap)  # fmt: skip
        work = Workload(seq_len=4096, global_batch_sequences=512, tokens_to_train=1e9)
        return estimate(qwen, cluster, plan, work).time_breakdown_s.ep_comm

    assert ep_s(1, True) == pytest.approx(ep_s(1, False))  # alone: nothing to hide behind
    exposed, plain = ep_s(4, True), ep_s(4, False)
    assert plain / 4 < exposed < plain  # a quarter stays exposed, the rest mostly hides


def test_fp32_main_grads_double_a_megatron_plans_gradients_and_their_traffic():
    """Workload.grad_reduce_in_fp32 (Megatron-LM's bf16 default): 4-byte gradients in memory, the expert
    slice's too, and in the reduction; NVIDIA's performance recipes (the default) keep them in bf16. Other
    engines keep their 16-bit gradients either way."""
    qwen = load_model("qwen3-30b-a3b")
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
    work = Workload(seq_len=4096, global_batch_sequences=512, tokens_to_train=1e9)
    plan = Plan(engine="megatron", dp=64, ep=8, zero_stage=1, micro_batch=1, grad_accum=8, comm_overlap=True)
    bf16, fp32 = (
        estimate(qwen, cluster, plan, work.model_copy(update={"grad_reduce_in_fp32": on}))
        for on in (False, True)
    )
    assert fp32.memory_per_gpu_bytes.grads == pytest.approx(2 * bf16.memory_per_gpu_bytes.grads)
    assert fp32.memory_per_gpu_bytes.experts > bf16.memory_per_gpu_bytes.experts
    assert fp32.time_breakdown_s.dp_comm > bf16.time_breakdown_s.dp_comm
    deepspeed = Plan(dp=64, zero_stage=1, micro_batch=1, grad_accum=8)
    llama = load_model("llama2-7b")
    same = [
        estimate(llama, cluster, deepspeed, work.model_copy(update={"grad_reduce_in_fp32": on}))
        for on in (0, 1)
    ]
    assert same[0].memory_per_gpu_bytes.total == same[1].memory_per_gpu_bytes.total
