"""Memory per GPU, one function per term. Every function takes numpy arrays (one element per plan) or
scalars, so the enumerator scores all plans in one pass with the same formulas `estimate()` uses.

Conventions: Ψ = parameters held by one GPU before ZeRO sharding (its TP shard of its pipeline
stage); d = bytes per activation element; bytes are bytes (not GiB).
"""

from __future__ import annotations

import numpy as np

from service.costmodel.types import Num, on_distinct
from service.spec.model import ModelSpec
from service.spec.plan_table import PlanTable, engine_table
from service.spec.zero import ZeroKnobs

FP32, BF16_FP16 = 4, 2
PRECISION_BF16 = 0  # index of "bf16" in PRECISION_CODES
PRECISION_FP32 = 2  # index of "fp32" in PRECISION_CODES
PRECISION_FP8 = 3  # index of "fp8" in PRECISION_CODES


def activation_bytes_per_element(precision: Num) -> Num:
    """2 bytes in bf16/fp16 mixed precision, 4 in fp32."""
    return np.where(precision == PRECISION_FP32, FP32, BF16_FP16)


def state_bytes_per_param(precision: Num, zero_stage: Num) -> tuple[np.ndarray, ...]:
    """(param, grad, optimizer) bytes per parameter as DeepSpeed keeps them, before sharding.

    Mixed precision (Rajbhandari et al. 2020, ZeRO, §3.1): 2-byte params and grads, and K = 12 bytes
    of optimizer state (fp32 master copy, Adam momentum and variance). In fp32, DeepSpeed's ZeRO
    optimizers still clone an fp32 master partition (stage_1_and_2.py `single_partition_of_fp32_groups`,
    stage3.py `fp32_partitioned_groups_flat`), so K = 12; without ZeRO the torch optimizer updates the
    fp32 params in place and K = 8 (momentum, variance).
    """
    fp32 = precision == PRECISION_FP32
    param = np.where(fp32, FP32, BF16_FP16)
    optimizer = np.where(fp32 & (zero_stage == 0), 8, 12)
    return param, param.copy(), optimizer


def plan_state_bytes(p: PlanTable, grad_reduce_in_fp32: bool = False) -> tuple[np.ndarray, ...]:
    """`state_bytes_per_param` for each plan's engine: with `grad_reduce_in_fp32`
    (Workload.grad_reduce_in_fp32), an engine that keeps fp32 main grads (the engine table's
    `fp32_main_grads`, with its source: Megatron-Core) holds and reduces 4 bytes per gradient in
    bf16/fp8 mixed precision instead of 2."""
    param, grad, optimizer = state_bytes_per_param(p.precision, p.zero_stage)
    if not grad_reduce_in_fp32:
        return param, grad, optimizer
    # bf16 and fp8 plans (fp16 ones accumulate in fp16 unless told; fp32 ones already hold 4 bytes)
    fp32_grads = p.engine_column("fp32_main_grads") & (
        (p.precision == PRECISION_BF16) | (p.precision == PRECISION_FP8)
    )
    return param, np.where(fp32_grads, FP32, grad), optimizer


def zero_sharded_bytes(
    num_params: Num,
    dp: Num,
    zero_stage: Num,
    param_bytes: Num,
    grad_bytes: Num,
    optimizer_bytes: Num,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(params, grads, optimizer) bytes per GPU after ZeRO sharding over `dp` ranks.

    ZeRO (Rajbhandari et al. 2020, §5, Fig. 1): stage 1 shards optimizer states, stage 2 also
    gradients, stage 3 also parameters: (2+2+K)Ψ → 2Ψ+2Ψ+KΨ/N → 2Ψ+(2+K)Ψ/N → (2+2+K)Ψ/N.
    """
    params = param_bytes * num_params / np.where(zero_stage >= 3, dp, 1)
    grads = grad_bytes * num_params / np.where(zero_stage >= 2, dp, 1)
    optimizer = optimizer_bytes * num_params / np.where(zero_stage >= 1, dp, 1)
    return params, grads, optimizer


def layer_params_per_gpu(model: ModelSpec, tp: Num) -> Num:
    """One transformer block's parameters on one TP rank: its matrices split by tp, norms whole
    (Shoeybi et al. 2019, Megatron-LM, §3: column/row-parallel attention and MLP), and the matrices TP
    keeps whole (MLA's down-projections, `MLASpec`)."""
    whole = model.attention_replicated_params_per_layer
    matrices = model.attention_params_per_layer + model.mlp_params_per_layer - whole
    return matrices / tp + whole + model.norm_params_per_layer


def stage_layers(num_layers: int, pp: Num, virtual_stages: Num = 1) -> tuple[np.ndarray, np.ndarray]:
    """Transformer blocks on the first and on the last of `pp` pipeline stages.

    The blocks split into pp·v model chunks (v = virtual_stages; stage r holds chunks r, r + pp, ...,
    Narayanan et al. 2021 §2.2.2) as evenly as their count allows: when pp·v does not divide it, the
    first L mod pp·v chunks hold one block more, as DeepSpeed's PipelineModule splits stages
    (runtime/utils.py `partition_uniform` and `partition_balanced` over unit weights put the extra blocks
    first); torchtitan splits uneven stages and Megatron-Core takes a pipeline layout, and the model
    prices them with this one. The first stage is then the busiest: its blocks set the pipeline's pace
    and its memory holds the most micro-batches.
    """
    if np.ndim(pp) == 0 and np.ndim(virtual_stages) == 0:
        return _stage_layers(num_layers, np.asarray(pp), np.asarray(virtual_stages))
    return on_distinct(lambda p, v: _stage_layers(num_layers, p, v), pp, virtual_stages)  # type: ignore[no-any-return]


def _stage_layers(num_layers: int, pp: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    chunks = pp * v
    base, extra = num_layers // chunks, num_layers % chunks
    first = v * base + np.minimum(v, np.ceil(extra / pp))
    last = np.where(pp == 1, num_layers, v * base + extra // pp)
    return np.asarray(first, dtype=float), np.asarray(last, dtype=float)


def vocab_parallel(engine: Num) -> np.ndarray:
    """Whether an engine splits the vocabulary over its TP ranks. Megatron does, in the input embedding
    (`VocabParallelEmbedding`) and in the loss (vocab-parallel cross-entropy never gathers the logits;
    Shoeybi et al. 2019, §3); so does torchtitan's TP plan (`tok_embeddings` RowwiseParallel, loss
    parallel). The DeepSpeed proxy keeps the input embedding whole on every TP rank and gathers the
    logits for the loss (service/train/tensor_parallel.py; measured, tests/train)."""
    return engine_table("vocab_parallel")[np.asarray(engine)]


def stage_params_per_gpu(
    model: ModelSpec, tp: Num, pp: Num, virtual_stages: Num = 1, vocab_split: Num = False
) -> tuple[np.ndarray, np.ndarray]:
    """Parameters per GPU on the first and on the last pipeline stage (before ZeRO).

    Blocks split as `stage_layers` says. The first stage also holds the input embedding, the
    last the final norm and the output projection (a copy of the embedding when tied and pp > 1, as
    DeepSpeed's TiedLayerSpec keeps one on each end). Tensor parallelism
    (service/train/tensor_parallel.py) splits the output projection by tp but keeps the input embedding
    whole on every TP rank (measured on the proxy, tests/train); engines with `vocab_split`
    (`vocab_parallel`) split it by tp too.
    """
    vocab = model.vocab_size * model.hidden_size
    embedding = vocab / np.where(vocab_split, tp, 1)
    first_layers, last_layers = stage_layers(model.num_layers, pp, virtual_stages)
    block = layer_params_per_gpu(model, tp)
    head = np.where(model.tie_word_embeddings & (pp == 1), 0.0, vocab / tp) + model.hidden_size
    first = block * first_layers + embedding + np.where(pp == 1, head, 0.0)
    last = np.where(pp == 1, first, block * last_layers + head)
    return first, last


def zero3_persistent_params(model: ModelSpec, tp: Num, pp: Num, virtual_stages: Num = 1) -> Num:
    """Parameters ZeRO-3 keeps whole on every rank: tensors smaller than
    `stage3_param_persistence_threshold` (DeepSpeed stage3 config), here the norm weights."""
    threshold = ZeroKnobs.for_model(model).stage3_param_persistence_threshold
    h = model.hidden_size
    first_layers = stage_layers(model.num_layers, pp, virtual_stages)[0]
    norms = model.norm_params_per_layer * first_layers + h * (np.asarray(pp) == 1)
    small = norms if h < threshold else np.zeros_like(norms, dtype=float)
    return np.asarray(small, dtype=float) * np.ones_like(tp, dtype=float)


def korthikanti_bytes_per_token_per_layer(
    model: ModelSpec, seq_len: int, tp: Num, sequence_parallel: Num, recompute: Num, flash: bool = False
) -> Num:
    """Activation bytes per token per layer of a GPT block in 16-bit with materialised attention scores
    and dropout (Korthikanti et al. 2022, §4, Table 2), i.e. the paper's formulas divided by s·b:
      no TP 34h + 5as;  TP 10h + 24h/t + 5as/t;  TP+SP (34h + 5as)/t;
      selective (attention core recomputed): 10h + 24h/t, or 34h/t with SP;  full: 2h, or 2h/t with SP.
    Flash attention keeps q, k, v and the output but no scores: the 5as terms vanish, so "none" costs
    what the paper's selective recompute does.
    """
    h, a = model.hidden_size, model.num_attention_heads
    sp = np.asarray(sequence_parallel, dtype=bool)
    scores = 0 if flash else 5 * a * seq_len
    none = np.where(sp, (34 * h + scores) / tp, 10 * h + (24 * h + scores) / tp)
    selective = np.where(sp, 34 * h / tp, 10 * h + 24 * h / tp)
    full = np.where(sp, 2 * h / tp, 2 * h)
    return np.select([recompute == 0, recompute == 1], [none, selective], full)


def activation_bytes_per_token_per_layer(
    model: ModelSpec,
    tp: Num,
    sequence_parallel: Num,
    recompute: Num,
    d: Num,
    seq_len: int = 0,
    flash: bool = True,
    precision: Num = 0,
    te: Num = False,
) -> Num:
    """Bytes one transformer block saves for backward per token, on one TP rank.

    `te`: the engine builds its blocks from Transformer Engine modules (Megatron-Core), counted by
    `te_layer_bytes_per_token` for SwiGLU blocks. In FP8 (`precision`), TE saves the inputs of the
    column-parallel GEMMs (QKV, MLP in) and of the MLP's output GEMM cast to FP8, 1 byte instead of d
    (`fp8_saved_input_discount`).

    GPT-style blocks (`mlp: gelu`) follow Korthikanti et al. 2022 (see above), scaled by d/2.
    Llama blocks are counted tensor by tensor as Hugging Face implements them with fused (flash / SDPA)
    attention, which saves no s×s scores: the structure of Korthikanti's §4.1 with Llama's terms in place
    of GPT's (RMSNorm instead of LayerNorm, SwiGLU instead of GeLU, no dropout, rotary, GQA):
      - each RMSNorm: its fp32 input (4h) and normalised output in d (d·h), then its result (d·h, the
        next matmuls' input) → 2 × (4 + 2d)h;
      - attention: what SDPA keeps, roped q and k, v and its output (o_proj's input), d(2h + 2kv), plus an
        fp32 log-sum-exp per head (4a); rope's multiplies by cos/sin save only cos/sin; 2h + 2kv is
        `q_width + kv_width + attention_out_width` where heads are not h / a wide; MLA (`MLASpec`) also
        keeps its two latent RMSNorms' tensors as the block's norms do, (4 + 2d) per latent element, whole
        on every TP rank (its down-projections are replicated);
      - MLP (swiglu): gate, silu(gate), up and their product, 4·d·f.
    Measured on the tiny proxy (fp32 and bf16, tests/train) within 0.4 % of this count.
    Tensor parallelism (Megatron-style splits) divides everything after the first
    matmul of each sub-block by tp; norm tensors stay whole on every rank unless sequence parallelism
    splits them too (Korthikanti §4.2.2).
    Recompute 1 (selective): each block's attention sub-block is checkpointed (Korthikanti's selective
    recompute of the attention core, widened to the projections since flash attention already keeps no
    scores): its saved tensors go, the norms and the MLP keep theirs.
    Recompute 2 (full): only the block input, d·h (Chen et al. 2016; Korthikanti §5).
    """
    discount = fp8_saved_input_discount(model, tp, sequence_parallel, recompute, d, precision)
    if model.mlp == "gelu":
        korthikanti = korthikanti_bytes_per_token_per_layer(
            model, seq_len, tp, sequence_parallel, recompute, flash
        )
        return korthikanti * d / 2 - discount
    h, f, heads_width = model.hidden_size, model.ffn_hidden_size, _attention_saved_width(model)
    norms = 2 * (FP32 + 2 * d) * h / np.where(sequence_parallel, tp, 1)
    latent = (FP32 + 2 * d) * model.latent_norm_width
    attention = (d * heads_width + FP32 * model.num_attention_heads) / tp + latent
    mlp = 4 * d * f / tp
    full = d * h / np.where(sequence_parallel, tp, 1)
    hf = np.select([recompute == 0, recompute == 1], [norms + attention + mlp, norms + mlp], full) - discount
    if not np.any(te):
        return hf
    return np.where(te, te_layer_bytes_per_token(model, tp, sequence_parallel, recompute, d, precision), hf)


def _attention_saved_width(model: ModelSpec) -> int:
    """Features per token fused attention keeps (q, k, v and its output): 2h + 2kv with h / a-wide heads."""
    return model.q_width + model.kv_width + model.attention_out_width


def fp8_saved_input_discount(
    model: ModelSpec, tp: Num, sequence_parallel: Num, recompute: Num, d: Num, precision: Num
) -> Num:
    """Bytes per token per layer FP8 saves on the GEMM inputs kept for backward: TE's `Linear` saves its
    input cast to FP8 (1 byte) for the weight-gradient GEMM (transformer_engine/pytorch/module/linear.py).
    The QKV and MLP-in inputs (h each, whole on a TP rank unless SP splits them) and the MLP-out input
    (f/tp) shrink from d to 1 byte; the attention output stays in d (the fused attention keeps it for its
    own backward). Selective recompute keeps only the MLP's two; full recompute saves no GEMM input."""
    fp8 = np.asarray(precision) == PRECISION_FP8
    h, f = model.hidden_size, model.ffn_hidden_size
    split = np.where(sequence_parallel, tp, 1)
    inputs = np.select([recompute == 0, recompute == 1], [2 * h / split + f / tp, h / split + f / tp], 0.0)
    return np.where(fp8, (d - 1) * inputs, 0.0)


def te_layer_bytes_per_token(
    model: ModelSpec, tp: Num, sequence_parallel: Num, recompute: Num, d: Num, precision: Num = 0
) -> Num:
    """Bytes one block saves for backward per token on one TP rank as Megatron-Core builds it with
    Transformer Engine modules, for the engines that run TE (`megatron`).

    Counted tensor by tensor as for `activation_bytes_per_token_per_layer`, with TE's modules in place of
    Hugging Face's. Column-parallel inputs (whole on each TP rank unless SP splits the sequence):
      - each of the two norms is fused into the following GEMM (`LayerNormLinear`, `LayerNormMLP`): it
        saves its input (d·h) and its output, the GEMM input (d·h; 1 byte per element in FP8, which TE
        saves cast) — no fp32 copy of the input, which Hugging Face's RMSNorm keeps.
    Split by tp:
      - attention (fused, no scores): q, k, v and the output, d(2h + 2kv), plus an fp32 log-sum-exp per
        head (4a); in FP8 the output projection also saves its FP8-cast input (1·h); MLA's latent norms
        (TENorm) keep their input and output, 2d per latent element, whole on every rank;
      - MLP: the fc1 output the fused SwiGLU backward needs (d·2f) and fc2's input (d·f; 1·f in FP8);
        GeLU MLPs keep fc1's output (d·f) and fc2's input (d·f, 1·f in FP8).
    TE `module/layernorm_linear.py`, `layernorm_mlp.py`, `linear.py` (`ctx.save_for_backward`), Megatron-Core
    `fusions/fused_bias_swiglu.py`. Selective recompute is Megatron's: the attention core alone is
    checkpointed (`_checkpointed_attention_forward` in megatron/core/transformer/attention.py passes q, k
    and v to the checkpoint, which keeps them; linear_proj keeps the output as its input), so with a fused
    kernel it drops only the log-sum-exp. Full recompute keeps the block input (d·h), as for the Hugging
    Face count."""
    h, f, heads_width = model.hidden_size, model.ffn_hidden_size, _attention_saved_width(model)
    g = np.where(np.asarray(precision) == PRECISION_FP8, 1, d)  # bytes of a saved GEMM input
    split = np.where(sequence_parallel, tp, 1)
    norm = (d + g) * h / split  # each of the two norms: its input and its output (the GEMM input)
    out = model.attention_out_width
    latent = 2 * d * model.latent_norm_width
    attention = (d * heads_width + FP32 * model.num_attention_heads + (g < d) * out) / tp + latent
    gate = 2 if model.mlp == "swiglu" else 1
    mlp = (d * gate * f + g * f) / tp
    full = d * h / split
    none = 2 * norm + attention + mlp
    selective = none - FP32 * model.num_attention_heads / tp
    return np.select([recompute == 0, recompute == 1], [none, selective], full)


def recompute_peak_bytes_per_token(
    model: ModelSpec,
    tp: Num,
    sequence_parallel: Num,
    recompute: Num,
    d: Num,
    seq_len: int = 0,
    flash: bool = True,
    precision: Num = 0,
    te: Num = False,
) -> Num:
    """Extra bytes alive while one block is recomputed in backward (full recompute re-creates that
    block's un-checkpointed activations; Korthikanti §5)."""
    zeros = np.zeros_like(recompute)
    block = activation_bytes_per_token_per_layer(
        model, tp, sequence_parallel, zeros, d, seq_len, flash, precision, te
    )
    return np.where(recompute == 2, block, 0.0)


def logits_bytes_per_token(
    model: ModelSpec,
    d: Num,
    seq_len: int,
    tp: Num = 1,
    sequence_parallel: Num = False,
    vocab_split: Num = False,
    fused_loss: bool = False,
) -> Num:
    """Bytes saved for backward by the output layer and loss, per token on the last stage: the final
    RMSNorm with its output, which is the output projection's input ((4 + 2d)·h), and the fp32
    log-softmax cross-entropy keeps over the s − 1 shifted positions (4·V·(s−1)/s). Tensor parallelism
    splits the output projection but gathers its logits, so the loss is whole on every TP rank.
    With sequence parallelism the final norm runs on the rank's s/t chunk and the output projection
    saves only that chunk (Megatron's `LinearWithGradAccumulationAndAsyncCommunication`, the proxy's
    `_SequenceGatherLinear`), so the (4 + 2d)·h part is divided by t (Korthikanti et al. 2022 §4.2.2).
    A vocab-parallel loss (`vocab_split`, see `vocab_parallel`) keeps V/t of the log-softmax per rank.
    A fused linear cross-entropy (`fused_loss`, Workload.fused_cross_entropy) keeps no log-softmax but
    the gradient of the output layer's input, computed in forward (d·h: Liger's `grad_input`)."""
    norm = (FP32 + 2 * d) * model.hidden_size / np.where(sequence_parallel, tp, 1)
    if fused_loss:
        return norm + d * model.hidden_size
    return norm + FP32 * model.vocab_size / np.where(vocab_split, tp, 1) * (seq_len - 1) / seq_len


def logits_transient_bytes_per_token(
    model: ModelSpec, d: Num, tp: Num = 1, vocab_split: Num = False, fused_loss: bool = False
) -> Num:
    """Bytes alive around the loss but not saved for backward: the logits themselves (d·V) and the
    fp32 gradient of the log-softmax in backward (4·V); V/t of each under a vocab-parallel loss. A fused
    linear cross-entropy holds one chunk of logits, at most tokens × h elements (Liger's chunk size,
    ceil(tokens / ceil(V/h)) rounded to a power of two): d·h per token."""
    if fused_loss:
        return d * model.hidden_size
    return (d + FP32) * model.vocab_size / np.where(vocab_split, tp, 1)


def fused_loss_buffer_bytes(model: ModelSpec, d: Num, fused_loss: bool) -> Num:
    """The fused linear cross-entropy's accumulator of the output layer's gradient, allocated in forward
    in the weight's dtype (Liger's `grad_weight = torch.zeros_like(weight)`): d·V·h on the last stage."""
    return d * model.vocab_size * model.hidden_size if fused_loss else 0.0


def micro_batches_in_flight(pp: Num, grad_accum: Num, virtual_stages: Num = 1) -> Num:
    """Micro-batches whose activations the first stage holds at once under 1F1B: min(pp, m)
    (Narayanan et al. 2021, §2.2.1; Korthikanti §4.2.3). Without a pipeline, one at a time. The
    interleaved schedule holds 1 + (pp − 1)/(pp·v) times as much (Korthikanti §4.2.3)."""
    interleave = np.where(virtual_stages > 1, 1 + (pp - 1) / (pp * virtual_stages), 1.0)
    return np.minimum(pp, grad_accum) * interleave


def zero_buffer_elements(model: ModelSpec, zero_stage: Num, params_per_gpu: Num) -> Num:
    """Elements of the communication buffers DeepSpeed allocates (see `service.spec.zero.ZeroKnobs`):
    stages 1-2 a gradient reduce bucket, a parameter all-gather bucket and a copy of the largest
    parameter (the embedding; stage_1_and_2.py `round_robin_bit16_meta`); stage 3 the reduce bucket, the
    prefetch bucket and the largest parameter gathered whole for its matmul; buckets capped by Ψ."""
    knobs = ZeroKnobs.for_model(model)
    largest_matrix = model.hidden_size * model.ffn_hidden_size
    s12 = (
        np.minimum(knobs.reduce_bucket_elements, params_per_gpu)
        + np.minimum(knobs.allgather_bucket_elements, params_per_gpu)
        + model.vocab_size * model.hidden_size
    )
    s3 = (
        np.minimum(knobs.reduce_bucket_elements, params_per_gpu)
        + knobs.stage3_prefetch_bucket_elements
        + largest_matrix
    )
    return np.select([zero_stage == 0, zero_stage <= 2], [0.0, s12], s3)
