"""FP8 training as Transformer Engine runs it on Hopper-class GPUs (precision code "fp8").

What runs in FP8: the GEMMs of the transformer blocks (QKV, attention output, MLP in and out) take
FP8 operands at the GPU's FP8 tensor-core rate (`GPUSpec.peak_tflops_fp8`, 2× bf16 on H100/H200),
with FP8 operands (1 byte) in the roofline's memory term. What stays bf16: the attention core (TE's
default; FP8 attention is opt-in), the embedding and the output layer with the loss (Micikevicius et al.
2022, "FP8 Formats for Deep Learning", §4: first and last layers in higher precision; NVIDIA TE docs,
"Using FP8 with Transformer Engine"), norms and element-wise ops, the activations between blocks, the
bf16 parameters, gradients and fp32 optimizer states (mixed precision as for bf16).

What FP8 adds (TE's `Linear`, DelayedScaling recipe):
* each GEMM input is cast to FP8 (read 2 bytes, write 1) before its GEMM;
* an FP8 copy of every weight and of its transpose (for the backward GEMMs), cached across the
  micro-batches of a step: 2 bytes per matmul parameter the GPU holds (of its shard under ZeRO-3 / FSDP,
  which gather weights module by module);
* an amax history per FP8 tensor (input, weight, output gradient of each GEMM): `amax_history_len`
  fp32 values (TE's DelayedScaling default 1,024).
"""

from __future__ import annotations

import numpy as np

from service.costmodel.types import Num
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec

PRECISION_FP8 = 3  # index of "fp8" in PRECISION_CODES
FP8_WEIGHT_COPY_BYTES = 2  # the FP8 weight and its transpose, 1 byte each
AMAX_HISTORY_LEN = 1024  # transformer_engine.common.recipe.DelayedScaling default
GEMMS_PER_LAYER = 4  # QKV, attention output, MLP in (gate and up fused), MLP out
FP8_TENSORS_PER_GEMM = 3  # input, weight, output gradient


def is_fp8(precision: Num) -> np.ndarray:
    return np.asarray(precision) == PRECISION_FP8


def gemm_peak_flops(precision: Num, gpu: GPUSpec, peak_flops: Num) -> Num:
    """The tensor-core rate of the block GEMMs: FP8 for fp8 plans, `peak_flops` otherwise. FP8 GEMMs
    reach a smaller share of their peak than bf16 GEMMs of theirs (`GPUSpec.fp8_gemm_efficiency_max`);
    the rate is scaled so that the GEMM time, which applies `gemm_efficiency_max`, ends at that share."""
    fp8_peak = (gpu.peak_tflops_fp8 or gpu.peak_tflops_bf16) * 1e12
    relative = (gpu.fp8_gemm_efficiency_max or gpu.gemm_efficiency_max) / gpu.gemm_efficiency_max
    return np.where(is_fp8(precision), fp8_peak * relative, peak_flops)


def gemm_operand_bytes(precision: Num, d: Num) -> Num:
    """Bytes per GEMM operand element: 1 in FP8, else the activation size `d`."""
    return np.where(is_fp8(precision), 1, d)


def cast_bytes_per_element(precision: Num, dynamic_scaling: Num = False) -> Num:
    """HBM bytes of casting one GEMM input element to FP8: read in bf16 (2), written in FP8 (1). With
    dynamic scaling (EngineRules.fp8_scaling: torchao's tensorwise Float8Linear) an amax reduction reads
    each input once more before the cast can scale it: 5 bytes; TE's delayed scaling takes the scale from
    its amax history and records the new amax in the cast kernel itself: 3. Zero for other precisions."""
    return np.where(is_fp8(precision), np.where(dynamic_scaling, 5.0, 3.0), 0.0)


def cast_bytes_per_token_per_layer(
    model: ModelSpec, tp: Num, precision: Num, dynamic_scaling: Num = False, mlp_share: float = 1.0
) -> Num:
    """HBM bytes of the FP8 casts of one block's GEMM inputs per token in forward: the QKV and MLP
    inputs (h, whole), the attention output and MLP hidden inputs (h/tp, f/tp). `mlp_share`: the share
    of blocks whose MLP input is cast here (a MoE model's dense view: its dense blocks and those with
    shared experts; the routed copies are cast in costmodel/moe.py)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return cast_bytes_per_element(precision, dynamic_scaling) * (h + mlp_share * h + (h + f) / tp)


def extra_memory_bytes(matmul_params_on_gpu: Num, stage_layers: Num, precision: Num) -> Num:
    """FP8 weight copies (2 bytes per matmul parameter held) plus the amax histories of the stage's
    `stage_layers` blocks."""
    tensors = np.asarray(stage_layers) * GEMMS_PER_LAYER * FP8_TENSORS_PER_GEMM
    extra = FP8_WEIGHT_COPY_BYTES * matmul_params_on_gpu + tensors * AMAX_HISTORY_LEN * 4
    return np.where(is_fp8(precision), extra, 0.0)
