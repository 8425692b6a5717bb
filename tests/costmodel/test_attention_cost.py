"""Attention priced by its projections' shapes: a head_dim other than h / a (Qwen3) and DeepSeek's multi-head
latent attention (MLA) in the FLOP counts, GEMM times, parameters per rank, saved activations and the
per-tensor lists. Dense models' numbers stay what they were (q_width = h, kv_width = 2·kv, out = h)."""

from __future__ import annotations

import numpy as np
import pytest

from service.catalog import load_gpu, load_model
from service.costmodel import buckets, compute, flops, recompute
from service.costmodel import memory as mem
from service.spec.model import ModelSpec

H100 = load_gpu("h100-sxm-80gb")
PEAK, D = H100.peak_tflops("bf16") * 1e12, 2.0
V3, QWEN3 = load_model("deepseek-v3"), load_model("qwen3-30b-a3b")


def test_attention_flops_follow_the_heads_widths() -> None:
    # Qwen3-30B-A3B: 32 heads of 128 on a 2048-wide model, so Q·Kᵀ and P·V are 4096 wide: twice 2h.
    tokens, s = np.array(4096.0), 4096
    assert flops.attention_core_flops_forward(QWEN3, tokens, s, 1) == pytest.approx(4096 * s * (4096 + 4096))
    # DeepSeek-V3: Q·Kᵀ over 128 heads × 192, P·V over 128 × 128; 6·L·s·(q + out) in model FLOPs.
    per_token = flops.model_flops_per_token(V3, s) - 6.0 * flops.matmul_params(V3)
    assert per_token == pytest.approx(6 * 61 * s * (128 * 192 + 128 * 128))
    dense = load_model("llama2-13b")
    assert flops.attention_core_flops_forward(dense, tokens, s, 2) == 2.0 * tokens * s * dense.hidden_size / 2


@pytest.mark.parametrize("tp", [1, 8])
def test_mla_gemms_run_projection_by_projection(tp: int) -> None:
    tokens = np.array(8192.0)
    expected = (
        compute.gemm_time_s(tokens, 1536, 7168, H100, PEAK, D)  # q_a_proj, whole on every rank
        + compute.gemm_time_s(tokens, 128 * 192 / tp, 1536, H100, PEAK, D)  # q_b_proj, column
        + compute.gemm_time_s(tokens, 512 + 64, 7168, H100, PEAK, D)  # kv_a_proj_with_mqa, whole
        + compute.gemm_time_s(tokens, 128 * 256 / tp, 512, H100, PEAK, D)  # kv_b_proj, column
        + compute.gemm_time_s(tokens, 7168, 128 * 128 / tp, H100, PEAK, D)  # o_proj, row
    )
    assert compute.attention_gemm_time_forward_s(V3, tokens, tp, H100, PEAK, D) == pytest.approx(expected)
    # Qwen3: one fused QKV GEMM of q + k + v = 4096 + 2·512 outputs, and o_proj's 4096 inputs.
    qkv = compute.gemm_time_s(tokens, 5120 / tp, 2048, H100, PEAK, D)
    out = compute.gemm_time_s(tokens, 2048, 4096 / tp, H100, PEAK, D)
    assert compute.attention_gemm_time_forward_s(QWEN3, tokens, tp, H100, PEAK, D) == pytest.approx(qkv + out)


def test_mla_down_projections_stay_whole_under_tensor_parallelism() -> None:
    whole = 7168 * 1536 + 7168 * 576
    split = V3.attention_params_per_layer + V3.mlp_params_per_layer - whole
    per_rank = mem.layer_params_per_gpu(V3, np.array(8.0))
    assert per_rank == pytest.approx(split / 8 + whole + 2 * 7168 + 1536 + 512)
    assert mem.layer_params_per_gpu(V3, np.array(1.0)) == V3.params_per_layer
    # The per-tensor list (registration order, latent norms after their down-projections) holds the block.
    tensors = buckets.block_tensor_elements(V3, 1)
    assert sum(tensors) == V3.params_per_layer and len(tensors) == V3.parameter_tensors_per_block
    assert tensors[:3] == [7168 * 1536, 1536, 1536 * 128 * 192]


def test_saved_activations_count_the_heads_and_the_latents() -> None:
    one = np.array(1.0)
    nothing = np.array(0)
    args = (one, np.array(False), nothing, D)
    qwen = mem.activation_bytes_per_token_per_layer(QWEN3.dense_view(), *args)
    narrow = QWEN3.dense_view().model_copy(update={"head_dim": 64})  # heads h / a wide: 2h + 2kv
    widths = (4096 + 2 * 512 + 4096) - (2048 + 2 * 256 + 2048)
    assert qwen - mem.activation_bytes_per_token_per_layer(narrow, *args) == pytest.approx(D * widths)
    v3 = mem.activation_bytes_per_token_per_layer(V3.dense_view(), *args)
    v3_tp8 = mem.activation_bytes_per_token_per_layer(V3.dense_view(), np.array(8.0), *args[1:])
    latent = (4 + 2 * D) * (1536 + 512)  # whole on every rank: the down-projections are replicated
    heads = D * 128 * (192 + 192 + 128 + 128) + 4 * 128
    assert v3 - v3_tp8 == pytest.approx((heads + D * 4 * V3.dense_view().ffn_hidden_size) * (1 - 1 / 8))
    assert v3 == pytest.approx(
        2 * (4 + 2 * D) * 7168 + heads + latent + 4 * D * V3.dense_view().ffn_hidden_size
    )


def test_selective_recompute_lists_follow_the_projections() -> None:
    features = recompute.matmul_output_features(V3, np.array(8.0), np.array(False))
    assert len(features) == V3.weight_matrices_per_block == 8
    assert features[:5] == [1536, 128 * 192 / 8, 576, 128 * 256 / 8, 7168]
    dense = load_model("llama2-13b")
    h = dense.hidden_size
    assert recompute.matmul_output_features(dense, np.array(2.0), np.array(False))[:4] == [
        h / 2,
        h / 2,
        h / 2,
        h,
    ]


def test_elementwise_traffic_rotates_only_the_rope_part() -> None:
    # MLA turns 64 of each head's 192 query features and one shared 64-wide key; Llama all of q and k.
    assert V3.rotary_width == 129 * 64
    eager = compute.elementwise_bytes_per_token_forward(V3, np.array(1.0), D)
    mlp = 5 * V3.ffn_hidden_size * 2 / 2
    assert eager == pytest.approx(D * (2 * 17 * 7168 + 17 * 2048 + 10 * 7168 + 6 * 2 * 129 * 64 + mlp))
    model = ModelSpec(num_layers=1, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=64, vocab_size=8)
    assert model.rotary_width == 2048 and model.latent_norm_width == 0
