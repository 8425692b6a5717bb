"""`run_profile`: times a model's kernels on this machine's device within a time budget.

CUDA when present (bf16, as production runs), else the CPU as a CPU proxy worker sees it: fp32 (the
CPU proxies' precision, `ds_config.proxy_precision`) on one thread (Ray gives each proxy worker one
CPU and sets OMP_NUM_THREADS to it). Shapes come from the model: its five matmuls at a few token
counts, causal attention at a few sequence lengths and head sizes; a square-matmul sweep finds the
device's best rate. Each section has a share of the budget and drops the shapes it has no time for.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any

from service.profile import kernels
from service.profile.derive import derive_overrides
from service.profile.record import AttentionResult, CollectiveResult, DeviceInfo, GemmResult, Profile
from service.profile.timing import Deadline, Timer
from service.spec.errors import SpecError
from service.spec.model import ModelSpec

# Each section's share of the time left when it starts (so what one leaves unused goes to the next):
# about 30 % model matmuls, 14 % square sweep, 25 % attention, 5 % bandwidth, 5 % launch, 5 % Adam,
# and the rest (~15 %) gloo collectives on CPU (their processes' start-up comes on top).
SHARES = {"gemm": 0.3, "square": 0.2, "attention": 0.45, "bandwidth": 0.2, "launch": 0.2, "adam": 0.25}
SQUARE_SIZES = (256, 512, 1024, 2048, 4096, 8192)
LAUNCH_OPS = 200


@dataclass(frozen=True)
class ProfileConfig:
    """What to time. Defaults depend on the device (see `default_config`)."""

    device: str
    dtype: str
    tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    attention_tokens: int
    bandwidth_elements: int
    adam_params: int
    threads: int | None  # CPU intra-op threads; None leaves torch's default
    collective_workers: int = 0  # CPU: gloo all-reduce among this many processes (0: not timed)


def default_config(device: str, seq_len: int | None = None, threads: int | None = None) -> ProfileConfig:
    """CUDA: bf16, production-sized token counts and sequences (`seq_len` added when given). CPU: fp32
    at the tiny proxy's sizes (1-4 sequences of 64 tokens), one thread."""
    if device == "cuda":
        # Up to 64k: the published long-sequence runs (16k-64k) are where the model errs most, and the
        # first H200 profile (1k-8k) showed attention flat past 4k, not still ramping up.
        lengths = {1024, 2048, 4096, 8192, 16384, 32768, 65536}
        seqs = tuple(sorted(lengths | ({seq_len} if seq_len else set())))
        return ProfileConfig(device, "bf16", (2048, 4096, 8192), seqs, 16384, 2**28, 2**24, threads)
    seqs = tuple(sorted({seq_len or 64, 256, 1024}))
    return ProfileConfig(device, "fp32", (64, 128, 256), seqs, 1024, 2**24, 2**22, threads or 1, 2)


def detect_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def catalog_gpu_for_device(device: str) -> str:
    """The catalog entry for this machine's device: `cpu`, or the CUDA GPU by name and memory."""
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    for key, entry in (("h200", "h200-sxm-141gb"), ("h100", "h100-sxm-80gb")):
        if key in name:
            return entry
    if "a100" in name:
        return "a100-sxm-80gb" if total_gib > 50 else "a100-sxm-40gb"
    raise SpecError("--base-gpu", f"no catalog entry for {name!r}; name one")


def model_gemm_shapes(model: ModelSpec, tokens: int) -> list[tuple[str, int, int, int]]:
    """(label, m, n, k) of the forward matmuls as the cost model counts them (compute.py): QKV fused,
    the output projection, the MLP in (gate and up fused for SwiGLU) and out, and the LM head."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, model.kv_heads * model.head_dim
    mlp_in = f * (2 if model.mlp == "swiglu" else 1)
    return [
        ("qkv", tokens, h + 2 * kv, h),
        ("out", tokens, h, h),
        ("mlp_in", tokens, mlp_in, h),
        ("mlp_out", tokens, h, f),
        ("lm_head", tokens, model.vocab_size, h),
    ]


def _device_info(device: str) -> DeviceInfo:
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, threads = torch.cuda.get_device_name(0), int(props.multi_processor_count)
    else:
        name, threads = _cpu_name(), torch.get_num_threads()
    return DeviceInfo(
        kind=device,
        name=name,
        threads=threads,
        torch_version=str(torch.__version__),
        platform=platform.platform(),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gemms(timer: Timer, cfg: ProfileConfig, model: ModelSpec, deadline: Deadline) -> list[GemmResult]:
    """The model's shapes at each token count, smallest first, while the section's time lasts."""
    shapes = [s for t in cfg.tokens for s in model_gemm_shapes(model, t)]
    out: list[GemmResult] = []
    for i, (label, m, n, k) in enumerate(shapes):
        if deadline.left_s() <= 0:
            break
        out.append(kernels.gemm(timer, label, m, n, k, cfg.dtype, deadline.left_s() / (len(shapes) - i)))
    return out


def _squares(timer: Timer, cfg: ProfileConfig, deadline: Deadline) -> list[GemmResult]:
    """Square matmuls of growing size per precision until one takes more than its slice: the best rate."""
    dtypes = (cfg.dtype,) if cfg.device == "cuda" else kernels.DTYPES
    out: list[GemmResult] = []
    for j, dtype in enumerate(dtypes):
        share = deadline.split(1 / (len(dtypes) - j))
        for size in SQUARE_SIZES:
            slice_s = share.left_s() / 3
            if slice_s <= 0:
                break
            r = kernels.gemm(timer, "square", size, size, size, dtype, slice_s)
            out.append(r)
            if r.seconds * (r.repeats + 2) > slice_s:  # the next size (8× the work) would not fit
                break
    return out


def run_profile(
    model: ModelSpec,
    budget_s: float = 60.0,
    device: str | None = None,
    base_gpu: str | None = None,
    config: ProfileConfig | None = None,
) -> Profile:
    """Times `model`'s kernels on `device` (default: CUDA if present, else CPU) in about `budget_s`."""
    if not budget_s > 0:
        raise SpecError("budget_s", f"must be positive seconds, got {budget_s}")
    import torch

    from service.catalog import load_gpu

    started, load_before = time.perf_counter(), _load_average()
    device = device or detect_device()
    cfg = config or default_config(device)
    base = load_gpu(base_gpu or catalog_gpu_for_device(device))
    threads_before = torch.get_num_threads()
    if device == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        m = _measure(Timer(device), cfg, model, Deadline(budget_s))
        info = _device_info(device)
    finally:
        torch.set_num_threads(threads_before)
    overrides, fit = derive_overrides(device, cfg.dtype, base, model.head_dim, **m)
    notes = [
        f"medians of repeated timings; 1-min load average {load_before} before, {_load_average()} after "
        f"on {os.cpu_count()} CPUs (a shared machine slows every figure)",
        "GEMM shapes are the cost model's (QKV and gate/up fused), forward only",
    ]
    if device == "cpu":
        notes.append(f"CPU timed on {cfg.threads or threads_before} thread(s), as one proxy worker")
    return Profile(
        device=info,
        model=model.name,
        dtype=cfg.dtype,
        budget_s=budget_s,
        wall_s=time.perf_counter() - started,
        base_gpu=base.name,
        **m,
        overrides=overrides,
        fit=fit,
        notes=notes,
    )


def _measure(timer: Timer, cfg: ProfileConfig, model: ModelSpec, budget: Deadline) -> dict[str, Any]:
    """Every section in turn, each within its share of what is left of `budget`."""
    gemm = _gemms(timer, cfg, model, budget.split(SHARES["gemm"]))
    gemm += _squares(timer, cfg, budget.split(SHARES["square"]))
    attention = _attention(timer, cfg, model, budget.split(SHARES["attention"]))
    bw_s = budget.split(SHARES["bandwidth"]).left_s() / 2
    bandwidth = [
        kernels.bandwidth(timer, op, cfg.bandwidth_elements, cfg.dtype, bw_s) for op in ("copy", "add")
    ]
    launch = kernels.launch(timer, LAUNCH_OPS, budget.split(SHARES["launch"]).left_s())
    # Host-side on every device: what an offloaded optimizer runs on.
    adam = kernels.adam(cfg.adam_params, budget.split(SHARES["adam"]).left_s())
    collectives: list[CollectiveResult] = []
    if timer.device == "cpu" and cfg.collective_workers > 1:
        from service.profile.collectives import gloo_all_reduce

        collectives = gloo_all_reduce(cfg.collective_workers, max(budget.left_s(), 1.0))
    return {
        "gemm": gemm,
        "attention": attention,
        "bandwidth": bandwidth,
        "launch": launch,
        "adam": adam,
        "collectives": collectives,
    }


def _attention(
    timer: Timer, cfg: ProfileConfig, model: ModelSpec, deadline: Deadline
) -> list[AttentionResult]:
    """Causal SDPA at each sequence length for the model's head size, then other head sizes (64, 128),
    keeping the model's width: heads = hidden / head_dim, batch = attention_tokens / seq_len."""
    head_dims = [model.head_dim] + [d for d in (64, 128) if d != model.head_dim]
    configs = [(s, d) for d in head_dims for s in cfg.seq_lens]
    out: list[AttentionResult] = []
    for i, (s, d) in enumerate(configs):
        if deadline.left_s() <= 0:
            break
        heads = max(1, model.hidden_size // d)
        batch = max(1, cfg.attention_tokens // s)
        out.append(
            kernels.attention(timer, batch, heads, s, d, cfg.dtype, deadline.left_s() / (len(configs) - i))
        )
    return out
