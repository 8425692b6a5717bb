"""Memory terms against published numbers and DeepSpeed's own estimators."""

import numpy as np
import pytest

from service.catalog import load_model
from service.costmodel import memory as mem
from service.spec import ModelSpec

BF16, FP32 = 0, 2


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_7_5b_example_at_dp64(stage, expected_gb):
    """ZeRO (Rajbhandari et al. 2020), Fig. 1: Ψ = 7.5B, N_d = 64, K = 12, mixed precision."""
    psi, dp = 7.5e9, 64
    pb, gb, ob = mem.state_bytes_per_param(np.array(BF16), np.array(stage))
    params, grads, opt = mem.zero_sharded_bytes(np.array(psi), np.array(dp), np.array(stage), pb, gb, ob)
    assert (params + grads + opt) / 1e9 == pytest.approx(expected_gb, abs=0.05)


# Megatron-LM docs/distrib_optimizer.md, "bytes per parameter": (param, grad, optimizer-side bytes) of
# each dtype mix, and the published totals without / with the distributed optimizer (= ZeRO-1).
MEGATRON_TABLE = [
    # fp16 params and grads; fp32 main grads, master params, Adam m and v on the optimizer side.
    ("fp16 param, fp16 grads", 2, 2, 16, 20, lambda d: 4 + 16 / d),
    ("bf16 param, fp32 grads", 2, 4, 12, 18, lambda d: 6 + 12 / d),
    ("fp32 param, fp32 grads", 4, 4, 8, 16, lambda d: 8 + 8 / d),
]


@pytest.mark.parametrize(
    "name,pb,gb,ob,plain,distributed", MEGATRON_TABLE, ids=[r[0] for r in MEGATRON_TABLE]
)
@pytest.mark.parametrize("dp", [1, 8, 64])
def test_megatron_bytes_per_parameter_table(name, pb, gb, ob, plain, distributed, dp):
    one = np.array(1.0)
    args = (np.array(dp), np.array(pb), np.array(gb), np.array(ob))
    p0, g0, o0 = mem.zero_sharded_bytes(one, args[0], np.array(0), *args[1:])
    p1, g1, o1 = mem.zero_sharded_bytes(one, args[0], np.array(1), *args[1:])
    assert p0 + g0 + o0 == pytest.approx(plain)
    assert p1 + g1 + o1 == pytest.approx(distributed(dp))


def test_deepspeed_keeps_an_fp32_master_copy_under_zero_even_in_fp32():
    pb, gb, ob = mem.state_bytes_per_param(np.array([FP32, FP32, BF16]), np.array([0, 1, 0]))
    assert list(pb) == [4, 4, 2] and list(gb) == [4, 4, 2] and list(ob) == [8, 12, 12]


@pytest.mark.parametrize("offload", [False, True])
def test_agrees_with_deepspeed_zero2_estimator(offload):
    """DeepSpeed's estimator counts 2Ψ + 18Ψ/N on the GPU: our 2Ψ + 14Ψ/N plus the fp32 gradient
    partition (4Ψ/N) it allocates for the optimizer step, which we leave out of the steady-state sum
    because activations are freed by then. With optimizer offload both give 2Ψ."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    model = load_model("llama2-13b")
    psi, nodes, per_node = model.num_params, 4, 8
    _, ds_gpu = estimate_zero2_model_states_mem_needs(psi, per_node, nodes, cpu_offload=offload)
    n = nodes * per_node
    pb, gb, ob = mem.state_bytes_per_param(np.array(BF16), np.array(2))
    params, grads, opt = mem.zero_sharded_bytes(np.array(psi), np.array(n), np.array(2), pb, gb, ob)
    ours = params + (0 if offload else grads + opt + 4 * psi / n)
    assert ours == pytest.approx(ds_gpu, rel=1e-6)


def test_agrees_with_deepspeed_zero3_estimator():
    """DeepSpeed: 4·largest_layer + 18Ψ/N. Ours: (2+2+12)Ψ/N, plus the fp32 gradient partition (4Ψ/N)
    at step time; DeepSpeed's 18 leaves out the 2-byte parameter partition (2Ψ/N), and its 4·largest
    layer is the gathered-parameter buffer we count under `buffers`."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    model = load_model("llama2-13b")
    psi, n = model.num_params, 32
    largest = model.hidden_size * model.ffn_hidden_size
    _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest, 8, 4, cpu_offload=False)
    pb, gb, ob = mem.state_bytes_per_param(np.array(BF16), np.array(3))
    params, grads, opt = mem.zero_sharded_bytes(np.array(psi), np.array(n), np.array(3), pb, gb, ob)
    ours = params + grads + opt + 4 * psi / n - 2 * psi / n + 4 * largest
    assert ours == pytest.approx(ds_gpu, rel=1e-6)


GPT3 = load_model("gpt3-175b")


@pytest.mark.parametrize(
    "tp,sp,recompute,formula",
    [
        # Korthikanti et al. 2022, Table 2, per layer: s·b·h × (...), s = 2048, a = 96, h = 12288.
        (1, False, 0, lambda s, h, a, t: 34 + 5 * a * s / h),
        (8, False, 0, lambda s, h, a, t: 10 + 24 / t + 5 * a * s / (h * t)),
        (8, True, 0, lambda s, h, a, t: (34 + 5 * a * s / h) / t),
        (8, False, 1, lambda s, h, a, t: 10 + 24 / t),
        (8, True, 1, lambda s, h, a, t: 34 / t),
        (8, False, 2, lambda s, h, a, t: 2),
    ],
)
def test_korthikanti_per_layer_activations(tp, sp, recompute, formula):
    s, h, a = 2048, GPT3.hidden_size, GPT3.num_attention_heads
    got = mem.activation_bytes_per_token_per_layer(
        GPT3, np.array(tp), np.array(sp), np.array(recompute), np.array(2), seq_len=s, flash=False
    )
    assert got == pytest.approx(h * formula(s, h, a, tp))


def test_korthikanti_175b_tp8_activation_total():
    """§4.2: GPT-3 175B, TP 8, s = 2048, b = 1: without recompute the 96 layers save
    sbhL(10 + 24/t + 5as/ht) bytes ≈ 52 GiB per GPU, which is why the paper needs SP + selective."""
    got = (
        2048
        * 96
        * mem.activation_bytes_per_token_per_layer(
            GPT3, np.array(8), np.array(False), np.array(0), np.array(2), seq_len=2048, flash=False
        )
    )
    assert got / 2**30 == pytest.approx(2048 * 12288 * 96 * (10 + 3 + 5 * 96 * 2048 / (12288 * 8)) / 2**30)
    assert 50 < got / 2**30 < 55


TINY = ModelSpec(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    ffn_hidden_size=160,
    vocab_size=100,
)


def test_llama_activation_terms_by_hand():
    """bf16, no TP: norms 2·(4+2d)h, attention d(2h+2kv) + 4a, MLP 4·d·f; selective drops the attention
    terms; full keeps the block input."""
    h, f, kv, a, d = 64, 160, 32, 4, 2
    norms, attention, mlp = 2 * (4 + 2 * d) * h, d * (2 * h + 2 * kv) + 4 * a, 4 * d * f
    args = (TINY, np.array(1), np.array(False))
    assert (
        mem.activation_bytes_per_token_per_layer(*args, np.array(0), np.array(d)) == norms + attention + mlp
    )
    assert mem.activation_bytes_per_token_per_layer(*args, np.array(1), np.array(d)) == norms + mlp
    assert mem.activation_bytes_per_token_per_layer(*args, np.array(2), np.array(d)) == d * h


def test_llama_activations_match_the_tiny_proxy_measurement():
    """tests/train measures 10,168 B per token per layer for experiments/tiny-cpu.yaml's model in fp32
    (h 128, 4 heads, kv 64, f 344): the count (10,128) is within 0.4 %."""
    from service.spec import load_experiment

    model = load_experiment("experiments/tiny-cpu.yaml").model
    got = mem.activation_bytes_per_token_per_layer(
        model, np.array(1), np.array(False), np.array(0), np.array(4)
    )
    assert got == pytest.approx(10_168, rel=0.005)


def test_recompute_orders_activation_memory_and_tp_shrinks_it():
    model = load_model("llama2-13b")
    by_policy = [
        mem.activation_bytes_per_token_per_layer(
            model, np.array(1), np.array(False), np.array(r), np.array(2)
        )
        for r in (0, 1, 2)
    ]
    assert by_policy[0] > by_policy[1] > by_policy[2]
    tp8 = mem.activation_bytes_per_token_per_layer(
        model, np.array(8), np.array(False), np.array(0), np.array(2)
    )
    tp8_sp = mem.activation_bytes_per_token_per_layer(
        model, np.array(8), np.array(True), np.array(0), np.array(2)
    )
    assert by_policy[0] / 8 <= tp8_sp < tp8 < by_policy[0]
    assert tp8_sp == pytest.approx(by_policy[0] / 8)


def test_stage_params_sum_to_the_model():
    model = load_model("llama2-7b")
    first, last = mem.stage_params_per_gpu(model, np.array([1, 1, 2]), np.array([1, 4, 1]))
    assert first[0] == model.num_params
    # Four stages: two ends hold the embedding / head; middle stages hold only layers.
    middle = model.num_layers / 4 * model.params_per_layer
    assert first[1] + last[1] + 2 * middle == pytest.approx(model.num_params)
    # TP 2 (DeepSpeed AutoTP) halves every matrix but keeps the norms and the input embedding whole.
    norms = 2 * model.hidden_size * model.num_layers + model.hidden_size
    embedding = model.vocab_size * model.hidden_size
    assert first[2] == pytest.approx((model.num_params - norms - embedding) / 2 + norms + embedding)


@pytest.mark.parametrize(("layers", "pp"), [(40, 1), (40, 8), (40, 16), (40, 32), (126, 16), (5, 2)])
def test_uneven_stages_are_laid_out_as_deepspeed_splits_them(layers, pp):
    """The first and last stage's blocks: DeepSpeed's PipelineModule (`partition_method="type:..."`,
    unit weights on the blocks, none on the embedding and head) puts the extra blocks first."""
    from deepspeed.runtime.utils import partition_balanced

    weights = [0] + [1] * layers + [0]
    parts = partition_balanced(weights=weights, num_parts=pp)
    blocks = [sum(weights[parts[i] : parts[i + 1]]) for i in range(pp)]
    first, last = mem.stage_layers(layers, np.array([pp]))
    assert (first[0], last[0]) == (blocks[0], blocks[-1]) == (max(blocks), min(blocks))


@pytest.mark.parametrize(
    ("layers", "pp", "v"), [(126, 8, 2), (80, 4, 5), (40, 8, 3), (126, 16, 4), (7, 2, 3)]
)
def test_interleaved_chunks_split_unevenly_put_their_extra_blocks_on_the_first_stages(layers, pp, v):
    """pp·v chunks, the first L mod pp·v one block longer; stage r holds chunks r, r + pp, ... ."""
    chunks = [layers // (pp * v) + (c < layers % (pp * v)) for c in range(pp * v)]
    per_stage = [sum(chunks[r::pp]) for r in range(pp)]
    first, last = mem.stage_layers(layers, np.array([pp]), np.array([v]))
    assert sum(per_stage) == layers
    assert (first[0], last[0]) == (per_stage[0], per_stage[-1]) and first[0] == max(per_stage)


def test_uneven_stage_params_sum_to_the_model():
    model = load_model("llama2-13b")  # 40 layers over 16 stages: 8 stages of 3 blocks, 8 of 2
    first, last = mem.stage_params_per_gpu(model, 1, np.array([16]))
    block = model.params_per_layer
    assert first[0] + last[0] + 7 * 3 * block + 7 * 2 * block == pytest.approx(model.num_params)
    assert first[0] - model.vocab_size * model.hidden_size == pytest.approx(3 * block)


def test_pipeline_in_flight_micro_batches():
    assert list(mem.micro_batches_in_flight(np.array([1, 4, 4]), np.array([8, 8, 2]))) == [1, 4, 2]


def test_flash_attention_drops_the_score_terms():
    """With flash attention a GPT block keeps what Korthikanti's selective recompute keeps."""
    args = (GPT3, np.array(8), np.array(False))
    flash_none = mem.activation_bytes_per_token_per_layer(*args, np.array(0), np.array(2), seq_len=2048)
    selective = mem.activation_bytes_per_token_per_layer(
        *args, np.array(1), np.array(2), seq_len=2048, flash=False
    )
    assert flash_none == pytest.approx(selective)


def test_sequence_parallelism_splits_the_final_norm():
    """Under SP the final norm and the output projection's saved input are the rank's s/t chunk:
    (4 + 2d)·h/t; the gathered logits' loss stays whole. Without SP tp changes nothing."""
    h, v, d, s = TINY.hidden_size, TINY.vocab_size, 2, 64
    loss = 4 * v * (s - 1) / s
    assert mem.logits_bytes_per_token(TINY, d, s) == pytest.approx((4 + 2 * d) * h + loss)
    assert mem.logits_bytes_per_token(TINY, d, s, 4, False) == pytest.approx((4 + 2 * d) * h + loss)
    assert mem.logits_bytes_per_token(TINY, d, s, 4, True) == pytest.approx((4 + 2 * d) * h / 4 + loss)


def test_a_fused_linear_cross_entropy_keeps_no_logits():
    """Liger's fused loss (Workload.fused_cross_entropy): no fp32 log-softmax saved, the input's gradient
    (d·h) instead; one chunk of logits (d·h per token) alive instead of d·V + 4·V; the output layer's
    gradient accumulated in a d·V·h buffer. Llama 3 8B at 128K tokens on one H200, ZeRO-3 with offload:
    the plan that ran in 66.5 GiB (ml-engineering) fits, where the materialised loss needs 199 GiB."""
    from service.costmodel import estimate
    from service.spec import ClusterSpec, Plan, Workload

    model, d, s = load_model("llama3-8b"), 2, 131072
    h, v = model.hidden_size, model.vocab_size
    norm = (4 + 2 * d) * h
    assert mem.logits_bytes_per_token(model, d, s, fused_loss=True) == pytest.approx(norm + d * h)
    assert mem.logits_transient_bytes_per_token(model, d, fused_loss=True) == pytest.approx(d * h)
    assert mem.fused_loss_buffer_bytes(model, d, True) == d * v * h
    assert mem.fused_loss_buffer_bytes(model, d, False) == 0
    cluster = ClusterSpec(gpu="h200-sxm-141gb", num_nodes=1)
    plan = Plan(dp=8, zero_stage=3, offload_optimizer=True, micro_batch=1, grad_accum=1, recompute="full")
    work = Workload(seq_len=s, global_batch_sequences=8, tokens_to_train=1e9)
    whole, fused = (
        estimate(model, cluster, plan, work.model_copy(update={"fused_cross_entropy": f}))
        for f in (False, True)
    )
    saved = s * (4 * v * (s - 1) / s - d * h)  # the log-softmax, less the input's gradient
    transient = s * ((d + 4) * v - d * h) - d * v * h
    before, after = whole.memory_per_gpu_bytes, fused.memory_per_gpu_bytes
    assert before.logits - after.logits == pytest.approx(saved)
    assert before.buffers - after.buffers == pytest.approx(transient)
    # a fully recomputed block's peak comes after the loss has freed its tensors: less freed, more held
    assert before.activations <= after.activations <= before.activations + saved
    assert fused.fits and not whole.fits
    assert fused.step_time_s == pytest.approx(whole.step_time_s)  # the same matmuls


def test_each_stage_holds_send_and_receive_buffers_for_its_own_micro_batches_in_flight():
    """1F1B keeps pp micro-batches in flight on the first stage and one on the last, so the last stage's
    stage-boundary buffers do not grow with the accumulation steps (they were the first stage's).
    DeepSpeed keeps every in-flight micro-batch's input and output (pipe_buffers); Megatron frees each
    sent output (deallocate_pipeline_outputs), so its buffers do not grow with the micro-batches in
    flight either."""
    from service.costmodel.step_memory import stage_memory_terms
    from service.spec import Plan, Workload
    from service.spec.plan_table import PlanTable

    model = load_model("llama3-70b")
    boundary = 2 * 4096 * model.hidden_size * 2  # activation and gradient of one micro-batch, bf16

    def buffers(ga: int, engine: str) -> tuple[float, float]:
        plan = Plan(engine=engine, dp=1, tp=8, pp=8, zero_stage=1, micro_batch=1, grad_accum=ga)
        work = Workload(seq_len=4096, global_batch_sequences=ga, tokens_to_train=1e9)
        first, last = stage_memory_terms(model, work, PlanTable.from_plans([plan]))
        return float(first.buffers[0]), float(last.buffers[0])

    (first_1, last_1), (first_64, last_64) = buffers(1, "deepspeed"), buffers(64, "deepspeed")
    assert last_64 == pytest.approx(last_1)
    assert first_64 - first_1 == pytest.approx(boundary * (8 - 1))  # 8 in flight against 1
    (first_1, last_1), (first_64, last_64) = buffers(1, "megatron"), buffers(64, "megatron")
    assert (first_64, last_64) == pytest.approx((first_1, last_1))
