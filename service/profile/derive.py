"""From measurements to `GPUSpec` fields, through the cost model's own formulas (costmodel/compute.py).

Each field is chosen so that the cost model, fed the profiled entry, reproduces the timed kernels:

- GEMM: the model times a matmul as 2mnk / (peak · gemm_efficiency_max · fill(m, n, k)), fill being
  the tile fill Π x/(x + TILE_HALF_FILL). So each timed shape gives a fill-corrected rate
  r = TFLOP/s / fill, and peak · gemm_efficiency_max = median r over the model's own shapes.
  On CUDA the peak is the datasheet's (catalog); on CPU there is no datasheet figure worth the name,
  so peak = the best r measured (square sweep included) and the efficiency is median r / peak.
- Attention: forward + backward = (1 + ATTENTION_BACKWARD_RATIO) · causal FLOPs /
  (peak · attention_efficiency · s/(s + ATTENTION_HALF_SEQ)), solved for the efficiency on each timed
  sequence length at the model's head size; the median is taken.
- `hbm_bandwidth_gb_per_s`: the large add (read 2, write 1), the pattern of the model's element-wise ops.
- `kernel_overhead_us`: the autograd chain, per kernel (1 forward + 2 backward per op, as counted there).
- `cpu_adam_gparams_per_s`: the AdamW step.
- CPU only, `intra_node_latency_us` and `intra_node_bandwidth_gb_per_s`: the gloo all-reduce among
  proxy workers (mean call time, as training issues them: profile/collectives.py), solved through
  `comm.all_reduce_time_s` itself (affine in the latency and in 1/bandwidth) at the two largest sizes.
"""

from __future__ import annotations

import math
import statistics

from service.costmodel import comm
from service.costmodel.compute import ATTENTION_BACKWARD_RATIO, ATTENTION_HALF_SEQ, TILE_HALF_FILL
from service.profile.record import (
    AdamResult,
    AttentionResult,
    BandwidthResult,
    CollectiveResult,
    GemmResult,
    LaunchResult,
)
from service.spec.hardware import GPUSpec

MODEL_LABELS = ("qkv", "out", "mlp_in", "mlp_out", "lm_head")


def _round(x: float, digits: int = 3) -> float:
    """`digits` significant figures: more would claim a precision a shared machine does not give."""
    return 0.0 if x == 0 else round(x, digits - 1 - math.floor(math.log10(abs(x))))


def tile_fill(m: float, n: float, k: float) -> float:
    return (m / (m + TILE_HALF_FILL)) * (n / (n + TILE_HALF_FILL)) * (k / (k + TILE_HALF_FILL))


def fill_corrected_tflops(r: GemmResult) -> float:
    return r.tflops / tile_fill(r.m, r.n, r.k)


def attention_implied_efficiency(r: AttentionResult, peak_tflops: float) -> float:
    """The `attention_efficiency` at which the cost model reproduces this forward + backward time."""
    seq_factor = r.seq_len / (r.seq_len + ATTENTION_HALF_SEQ)
    work = r.forward_flops * (1 + ATTENTION_BACKWARD_RATIO)
    return work / ((r.forward_s + r.backward_s) * peak_tflops * 1e12 * seq_factor)


def _all_reduce_model_s(r: CollectiveResult, base: GPUSpec, latency_us: float, gb_per_s: float) -> float:
    spec = base.model_copy(
        update={"intra_node_latency_us": latency_us, "intra_node_bandwidth_gb_per_s": gb_per_s}
    )
    return float(comm.all_reduce_time_s(r.bytes, r.world, 1, r.world, spec))


def link_from_all_reduce(collectives: list[CollectiveResult], base: GPUSpec) -> tuple[float, float] | None:
    """(intra_node_latency_us, intra_node_bandwidth_gb_per_s) at which the cost model reproduces two
    timed all-reduces; None without two sizes.

    The model is affine in the latency and in 1/bandwidth, so two sizes fix both (a 2×2 solve). With
    three or more sizes the two largest are used: a one-float all-reduce takes gloo's small-message path
    (~0.2 ms on loopback TCP against ~1 ms from 4 KiB up), which no bucketed gradient reduction takes.
    """
    rs = sorted((r for r in collectives if r.op == "all_reduce"), key=lambda r: r.bytes)
    if len(rs) < 2:
        return None
    pair = rs[-2:] if len(rs) >= 3 else [rs[0], rs[-1]]
    rows, rhs = [], []
    for r in pair:
        fixed = _all_reduce_model_s(r, base, 0.0, 1e12)  # neither latency nor bandwidth term
        per_us = _all_reduce_model_s(r, base, 1.0, 1e12) - fixed  # seconds per µs of hop latency
        per_inverse_gb = _all_reduce_model_s(r, base, 0.0, 1.0) - fixed  # seconds at 1 GB/s
        rows.append([per_us, per_inverse_gb])
        rhs.append(r.seconds - fixed)
    (a, b), (c, d) = rows
    det = a * d - b * c
    if abs(det) < 1e-30:
        return None
    latency_us = (rhs[0] * d - b * rhs[1]) / det
    inverse_gb = (a * rhs[1] - c * rhs[0]) / det
    if latency_us < 0:  # the two sizes say bandwidth only: the largest message's rate, no latency
        latency_us, inverse_gb = 0.0, rhs[1] / d
    if inverse_gb <= 0:  # latency only: the smaller message's latency, bandwidth left as in the catalog
        return rhs[0] / a, base.intra_node_bandwidth_gb_per_s
    return latency_us, 1.0 / inverse_gb


def fused_attention_override(base: GPUSpec, attention_efficiency: float) -> dict[str, float]:
    """The profile timed SDPA's own choice of kernel: cuDNN's on Hopper from torch 2.11
    (Workload.cudnn_attention). A measured rate at or above the catalog's cuDNN rate is that kernel's, so
    the profiled spec's cuDNN rate is raised to it rather than applied a second time on top."""
    if base.fused_attention_efficiency is None:
        return {}
    return {"fused_attention_efficiency": _round(max(base.fused_attention_efficiency, attention_efficiency))}


def derive_overrides(
    kind: str,
    dtype: str,
    base: GPUSpec,
    head_dim: int,
    gemm: list[GemmResult],
    attention: list[AttentionResult],
    bandwidth: list[BandwidthResult],
    launch: LaunchResult,
    adam: AdamResult | None,
    collectives: list[CollectiveResult] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """(GPUSpec overrides, intermediate numbers of the fit) for a profile on `kind` ("cuda" or "cpu")
    whose model shapes were timed in `dtype`."""
    overrides: dict[str, float] = {}
    fit: dict[str, float] = {}
    peaks = {p: base.peak_tflops(p) for p in ("bf16", "fp16", "fp32")}
    if kind == "cpu":  # measured peaks, one per precision timed
        for p in peaks:
            rates = [fill_corrected_tflops(r) for r in gemm if r.dtype == p]
            if rates:
                peaks[p] = max(rates)
                overrides[f"peak_tflops_{p}"] = _round(peaks[p])
    model_rates = [fill_corrected_tflops(r) for r in gemm if r.dtype == dtype and r.label in MODEL_LABELS]
    if model_rates:
        sustained = statistics.median(model_rates)
        fit["gemm_fill_corrected_tflops_median"] = sustained
        overrides["gemm_efficiency_max"] = _round(min(1.0, sustained / peaks[dtype]))
    at_head = [r for r in attention if r.head_dim == head_dim] or attention
    if at_head:
        implied = [attention_implied_efficiency(r, peaks[dtype]) for r in at_head]
        for r, e in zip(at_head, implied, strict=True):
            fit[f"attention_efficiency_s{r.seq_len}_d{r.head_dim}"] = e
        overrides["attention_efficiency"] = _round(min(1.0, max(statistics.median(implied), 1e-4)))
        overrides.update(fused_attention_override(base, overrides["attention_efficiency"]))
        fit["attention_backward_over_forward_median"] = statistics.median(
            r.backward_over_forward for r in at_head
        )
    adds = [r.gb_per_s for r in bandwidth if r.op == "add"] or [r.gb_per_s for r in bandwidth]
    if adds:
        overrides["hbm_bandwidth_gb_per_s"] = _round(max(adds))
    overrides["kernel_overhead_us"] = _round(launch.autograd_us_per_kernel)
    if adam is not None:
        overrides["cpu_adam_gparams_per_s"] = _round(adam.gparams_per_s)
    link = link_from_all_reduce(collectives or [], base) if kind == "cpu" else None
    if link is not None:
        overrides["intra_node_latency_us"] = _round(link[0])
        overrides["intra_node_bandwidth_gb_per_s"] = _round(link[1])
    return overrides, fit
