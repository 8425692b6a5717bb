"""What Megatron-Core with Transformer Engine runs differently from the DeepSpeed proxy: its overlaps
(`Plan.tp_comm_overlap`, `Plan.comm_overlap`), cuDNN's fused attention on Hopper, and its memory layout
(vocab-parallel embedding and loss, in-place optimizer buffers, TE's saved tensors)."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import comm, estimate
from service.costmodel import memory as mem
from service.spec import ClusterSpec, Plan, Workload
from service.spec.params import ModelParams
from service.spec.plan_checks import check_plan
from service.spec.plan_table import PRECISION_CODES

PRIOR = ModelParams()
LLAMA70 = load_model("llama3-70b")
NODE = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1)
WORK = Workload(seq_len=8192, global_batch_sequences=16, tokens_to_train=1e9)


def _run(plan: Plan, cluster: ClusterSpec = NODE, model=LLAMA70, workload: Workload = WORK):
    return estimate(model, cluster, plan, workload, params=PRIOR)


def test_overlap_flags_belong_to_megatron_and_tp_overlap_needs_sequence_parallel():
    with pytest.raises(ValueError, match=r"comm_overlap: .*needs engine megatron, not deepspeed"):
        Plan(tp=8, grad_accum=16, comm_overlap=True)
    with pytest.raises(ValueError, match=r"tp_comm_overlap: .*needs engine megatron, not fsdp"):
        Plan(tp=8, grad_accum=16, engine="fsdp", tp_comm_overlap=True)
    # megatron/training/arguments.py asserts sequence parallelism for --tp-comm-overlap.
    with pytest.raises(ValueError, match="tp_comm_overlap: tp_comm_overlap needs sequence_parallel"):
        Plan(tp=8, grad_accum=16, engine="megatron", tp_comm_overlap=True)
    plan = Plan(tp=8, grad_accum=16, engine="megatron", sequence_parallel=True, tp_comm_overlap=True)
    assert check_plan(plan, LLAMA70).short().endswith("-sp-tpo")


def test_tp_overlap_hides_every_tensor_parallel_collective_behind_the_gemms():
    """With TE userbuffers each of the 4 collective volumes of a block runs behind a GEMM: the step pays
    only the contention (the GEMMs of a 70B block on tp 8 outlast the NVLink transfers)."""
    base = Plan(tp=8, grad_accum=16, engine="megatron", sequence_parallel=True)
    plain = _run(base).time_breakdown_s.tp_comm
    overlapped = _run(base.model_copy(update={"tp_comm_overlap": True})).time_breakdown_s.tp_comm
    deepspeed = _run(base.model_copy(update={"engine": "deepspeed"})).time_breakdown_s.tp_comm
    kappa = PRIOR["overlap_contention"]
    assert overlapped == pytest.approx(kappa * deepspeed, rel=1e-6)
    assert overlapped < plain < deepspeed


def test_comm_overlap_hides_interleaved_pipeline_sends_and_the_optimizer_gathers():
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    workload = Workload(seq_len=8192, global_batch_sequences=32, tokens_to_train=1e9)
    plan = Plan(dp=2, tp=4, pp=4, virtual_stages=5, zero_stage=1, grad_accum=16, engine="megatron")
    plain = _run(plan, cluster, workload=workload).time_breakdown_s
    over = _run(plan.model_copy(update={"comm_overlap": True}), cluster, workload=workload).time_breakdown_s
    kappa = PRIOR["overlap_contention"]
    # The sends are far shorter than a chunk's compute: only their contention is left.
    assert over.pp_comm == pytest.approx(kappa * plain.pp_comm, rel=1e-6)
    assert over.dp_comm < plain.dp_comm
    # Without interleaving Megatron-Core has no p2p overlap.
    flat = plan.model_copy(update={"virtual_stages": 1})
    assert (
        _run(
            flat.model_copy(update={"comm_overlap": True}), cluster, workload=workload
        ).time_breakdown_s.pp_comm
        == _run(flat, cluster, workload=workload).time_breakdown_s.pp_comm
    )


def test_megatron_runs_cudnn_attention_on_hopper_only():
    """TE's cuDNN attention is 0.53/0.35 of FlashAttention-2's time on H100 (catalog); on A100 there is
    no faster kernel. The DeepSpeed side runs SDPA's FlashAttention-2 (torch before 2.11:
    `cudnn_attention` false) and is given fused element-wise kernels, which TE's layers always have."""
    h100, a100 = load_gpu("h100-sxm-80gb"), load_gpu("a100-sxm-80gb")
    assert h100.fused_attention_efficiency == 0.53 and a100.fused_attention_efficiency is None
    plan = Plan(tp=8, grad_accum=16, sequence_parallel=True)
    fused = WORK.model_copy(update={"fused_elementwise": True, "cudnn_attention": False})
    ratio = {}
    for gpu in ("h100-sxm-80gb", "a100-sxm-80gb"):
        cluster = ClusterSpec(gpu=gpu, num_nodes=1)
        ds = _run(plan, cluster, workload=fused).time_breakdown_s.compute
        mg = _run(plan.model_copy(update={"engine": "megatron"}), cluster).time_breakdown_s.compute
        ratio[gpu] = mg / ds
    # On A100 only the optimizer step differs (Megatron's rank holds 1/tp of the embedding).
    assert ratio["a100-sxm-80gb"] == pytest.approx(1.0, rel=1e-3)
    # At seq 8192 causal attention is ~8 % of a 70B block's FLOPs, ~15 % of its math time at the prior.
    assert 0.93 < ratio["h100-sxm-80gb"] < 0.99


def test_megatron_splits_the_vocabulary_over_tensor_parallel_ranks():
    """VocabParallelEmbedding and the vocab-parallel loss: the embedding and the fp32 log-softmax are
    1/tp on each rank; the DeepSpeed proxy keeps the embedding whole and gathers the logits."""
    v, h, tp = LLAMA70.vocab_size, LLAMA70.hidden_size, 8
    ds_first, _ = mem.stage_params_per_gpu(LLAMA70, tp, 4)
    mg_first, _ = mem.stage_params_per_gpu(LLAMA70, tp, 4, 1, mem.vocab_parallel(np.array(2)))
    assert ds_first - mg_first == pytest.approx(v * h * (1 - 1 / tp))
    whole = mem.logits_bytes_per_token(LLAMA70, 2, 8192, tp, True)
    split = mem.logits_bytes_per_token(LLAMA70, 2, 8192, tp, True, True)
    assert whole - split == pytest.approx(4 * v * (1 - 1 / tp) * 8191 / 8192)
    assert mem.logits_transient_bytes_per_token(LLAMA70, 2, tp, True) == pytest.approx((2 + 4) * v / tp)
    assert list(mem.vocab_parallel(np.array([0, 1, 2]))) == [False, True, True]


def test_te_saves_less_than_hugging_face_and_fp8_saves_its_gemm_inputs_in_one_byte():
    """Per token per layer on one rank, Llama 3 70B (h 8192, kv 1024, f 28672, 64 heads), tp 4 + SP:
    bf16: norms 2·(2 + 2)h/4, attention (2(2h + 2kv) + 4a)/4, SwiGLU (2·2f + 2f)/4;
    fp8: GEMM inputs in 1 byte (the two norm outputs, fc2's input) plus the projection's FP8 copy (h/4)."""
    h, kv, f, a = 8192, 1024, 28672, 64
    bf16, fp8 = PRECISION_CODES.index("bf16"), PRECISION_CODES.index("fp8")
    te_bf16 = mem.te_layer_bytes_per_token(LLAMA70, 4, True, np.array(0), 2, bf16)
    assert te_bf16 == pytest.approx((2 * 4 * h + 2 * (2 * h + 2 * kv) + 4 * a + 6 * f) / 4)
    te_fp8 = mem.te_layer_bytes_per_token(LLAMA70, 4, True, np.array(0), 2, fp8)
    assert te_fp8 == pytest.approx((2 * 3 * h + 2 * (2 * h + 2 * kv) + 4 * a + h + 5 * f) / 4)
    hf = mem.activation_bytes_per_token_per_layer(LLAMA70, 4, True, np.array(0), 2)
    assert te_fp8 < te_bf16 < hf
    # The Hugging Face count in FP8 loses (d - 1) bytes on the same inputs: 2h/tp (SP) + f/tp.
    hf_fp8 = mem.activation_bytes_per_token_per_layer(LLAMA70, 4, True, np.array(0), 2, precision=fp8)
    assert hf - hf_fp8 == pytest.approx(2 * h / 4 + f / 4)
    # Full recompute keeps block inputs only, whatever the module library.
    full = mem.te_layer_bytes_per_token(LLAMA70, 4, True, np.array(2), 2, fp8)
    assert full == pytest.approx(2 * h / 4)


def test_megatron_pays_no_deepspeed_buckets():
    plan = Plan(tp=8, grad_accum=16, zero_stage=1, sequence_parallel=True)
    ds = _run(plan).memory_per_gpu_bytes.buffers
    mg = _run(plan.model_copy(update={"engine": "megatron"})).memory_per_gpu_bytes.buffers
    assert mg < ds - 0.5e9  # DeepSpeed's reduce and gather buckets plus a copy of the embedding
    assert comm.NCCL_BUS_EFFICIENCY == 0.8  # the overlap tests above run at the analytical prior


def test_blackwell_entries_and_an_nvl72_domain_keep_groups_on_nvlink():
    """B200 and GB200 come from their datasheets (dense = sparse / 2) with H100's kernel efficiencies
    (assumed, said in the entry); a GB200 NVL72 rack is one 72-GPU NVLink domain, so a cluster of them
    says gpus_per_node 72 and its data-parallel traffic stays on NVLink."""
    b200, gb200 = load_gpu("b200-sxm-180gb"), load_gpu("gb200-nvl72")
    assert (b200.peak_tflops_bf16, b200.peak_tflops_fp8) == (2250.0, 4500.0)
    assert (gb200.peak_tflops_bf16, gb200.peak_tflops_fp8) == (2500.0, 5000.0)
    assert "assumed" in b200.source and "assumed" in gb200.source
    plan = Plan(dp=9, tp=8, grad_accum=16, engine="megatron", zero_stage=1, sequence_parallel=True)
    racks = ClusterSpec(gpu="gb200-nvl72", num_nodes=1, gpus_per_node=72)
    trays = ClusterSpec(gpu="gb200-nvl72", num_nodes=9, gpus_per_node=8)
    work = Workload(seq_len=8192, global_batch_sequences=144, tokens_to_train=1e9)
    on_nvlink = _run(plan, racks, workload=work).time_breakdown_s.dp_comm
    assert on_nvlink < _run(plan, trays, workload=work).time_breakdown_s.dp_comm / 5


def test_megatron_fsdp_shards_like_fsdp_without_a_pipeline():
    """Megatron-FSDP (--use-megatron-fsdp; ZeRO 2-3 on megatron) gathers and reduces per transformer
    layer as FSDP does; with tp 1 the two engines' data-parallel time is the same."""
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
    work = Workload(seq_len=8192, global_batch_sequences=128, tokens_to_train=1e9)
    plan = Plan(dp=64, zero_stage=3, grad_accum=2, engine="megatron")
    fsdp = plan.model_copy(update={"engine": "fsdp"})
    assert _run(plan, cluster, workload=work).time_breakdown_s.dp_comm == pytest.approx(
        _run(fsdp, cluster, workload=work).time_breakdown_s.dp_comm, rel=1e-9
    )
    with pytest.raises(ValueError, match="priced without a pipeline"):
        Plan(dp=16, pp=4, zero_stage=2, grad_accum=8, engine="megatron")


def test_interleaved_chunks_reduce_and_gather_behind_the_other_chunks_compute():
    """Megatron-Core keeps a grad/param buffer per model chunk: with v chunks only the last chunk's
    reduce and the first chunk's gather wait on their own micro-batch; the other (v − 1)/v run behind
    the other chunks' compute. Without contention and with compute c per micro-batch where
    min(reduce, gather) ≥ c ≥ (reduce + gather)/pp, v = 1 exposes (reduce − c) + (gather − c) and v
    chunks expose exactly 1/v of that."""
    from service.costmodel import data_parallel
    from service.spec.plan_table import PlanTable

    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=8)
    base = dict(dp=8, tp=8, pp=8, zero_stage=1, grad_accum=16, engine="megatron")
    gpu, net = cluster.gpu, comm.Links()

    def exposed(v: int, compute_s: float, overlap: bool = True) -> float:
        plan = Plan(**base, comm_overlap=overlap, virtual_stages=v)
        c = np.array([compute_s])
        table = PlanTable.from_plans([plan])
        traffic = data_parallel.zero_traffic(LLAMA70, cluster, table, gpu, net)
        return float(data_parallel.exposed_comm_s(traffic, table, c, c)[0])

    total = exposed(1, 0.0)  # reduce + gather with nothing to hide behind
    assert exposed(4, 0.0) == pytest.approx(total)  # chunks do not shrink the traffic
    c = total / 8  # = (reduce + gather)/pp, ≤ each of them (they are of similar size)
    assert exposed(4, c) == pytest.approx(exposed(1, c) / 4, rel=1e-9)
    assert exposed(1, c) == pytest.approx(total - 2 * c, rel=1e-9)
    # Without --overlap-grad-reduce / --overlap-param-gather, the chunks change nothing.
    assert exposed(4, c, overlap=False) == pytest.approx(exposed(1, c, overlap=False))


def test_megatron_selective_recompute_keeps_q_k_v_and_drops_only_the_log_sum_exp():
    """The checkpoint keeps its inputs (q, k, v) and linear_proj keeps the output as its input: with a
    fused kernel, selective recompute frees only the fp32 log-sum-exp per head (4a/tp)."""
    bf16 = PRECISION_CODES.index("bf16")
    none = mem.te_layer_bytes_per_token(LLAMA70, 4, True, np.array(0), 2, bf16)
    selective = mem.te_layer_bytes_per_token(LLAMA70, 4, True, np.array(1), 2, bf16)
    assert none - selective == pytest.approx(4 * 64 / 4)


def test_interleaved_micro_batches_group_as_each_engine_takes_them():
    """Megatron's interleaved schedule takes micro-batches in groups of pp: a number that is not a
    multiple is refused. torch's (fsdp) runs max(1, m // pp) rounds and needs m a multiple of them, so
    fewer than pp run, in one round; then a chunk's round trip is pp slots of which only grad_accum are
    busy: the bubble is the plain 1F1B one."""
    from service.spec.plan_checks import plan_problem

    llama = load_model("llama2-13b")
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=4)
    work = Workload(seq_len=4096, global_batch_sequences=16, tokens_to_train=1e9)

    def problem(engine: str, pp: int, ga: int, zero: int) -> tuple[str, str] | None:
        plan = Plan(engine=engine, dp=32 // pp, pp=pp, virtual_stages=2, zero_stage=zero, micro_batch=1,
                    grad_accum=ga)  # fmt: skip
        return plan_problem(
            plan, llama, cluster, work.model_copy(update={"global_batch_sequences": ga * 32 // pp})
        )

    assert problem("megatron", 8, 4, 1) == (
        "grad_accum",
        "megatron's interleaved schedule takes micro-batches in groups of pp 8: grad_accum 4 is not a "
        "multiple",
    )
    assert problem("megatron", 8, 12, 1) is not None and problem("megatron", 8, 16, 1) is None
    assert problem("fsdp", 8, 4, 0) is None  # one round of 4
    assert problem("fsdp", 4, 11, 0) == (
        "grad_accum",
        "fsdp's interleaved schedule runs grad_accum 11 in 2 rounds of pp 4: not a multiple of the rounds",
    )
    assert problem("fsdp", 4, 12, 0) is None  # 3 rounds of 4
    fsdp = Plan(engine="fsdp", dp=4, pp=8, zero_stage=0, micro_batch=1, grad_accum=4)
    plain, interleaved = (
        estimate(llama, cluster, fsdp.model_copy(update={"virtual_stages": v}), work).time_breakdown_s.bubble
        for v in (1, 5)
    )
    assert interleaved == pytest.approx(plain, rel=0.05)  # not a fifth of it
