"""The timed kernels: matmuls, causal SDPA forward/backward, element-wise bandwidth, per-op overhead and
an Adam step. torch is imported inside each function so that `import service` stays light."""

from __future__ import annotations

from typing import Any

from service.profile.record import AdamResult, AttentionResult, BandwidthResult, GemmResult, LaunchResult
from service.profile.timing import Timer

DTYPES = ("fp32", "bf16", "fp16")


def torch_dtype(name: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def gemm(timer: Timer, label: str, m: int, n: int, k: int, dtype: str, budget_s: float) -> GemmResult:
    """`F.linear(x, w)` with x (m×k), w (n×k): the forward of an `nn.Linear` as the proxy model runs it."""
    import torch

    dt = torch_dtype(dtype)
    x = torch.randn(m, k, device=timer.device, dtype=dt)
    w = torch.randn(n, k, device=timer.device, dtype=dt) / k**0.5
    with torch.no_grad():
        seconds, repeats = timer.median_s(lambda: torch.nn.functional.linear(x, w), budget_s)
    tflops = 2.0 * m * n * k / seconds / 1e12
    return GemmResult(
        label=label, m=m, n=n, k=k, dtype=dtype, seconds=seconds, repeats=repeats, tflops=tflops
    )


def attention(
    timer: Timer, batch: int, heads: int, seq_len: int, head_dim: int, dtype: str, budget_s: float
) -> AttentionResult:
    """Causal SDPA (flash on CUDA where it applies; the fused CPU kernel on CPU), forward alone and
    forward + backward; backward = the difference."""
    import torch
    import torch.nn.functional as F

    dt = torch_dtype(dtype)
    shape = (batch, heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, device=timer.device, dtype=dt, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=timer.device, dtype=dt)

    def forward() -> None:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    fwd_s, _ = timer.median_s(forward, budget_s / 3)
    total_s, _ = timer.median_s(forward_backward, 2 * budget_s / 3)
    bwd_s = max(total_s - fwd_s, 1e-3 * fwd_s)  # noise can make the difference tiny; never zero
    # Causal: half of the 2 matmuls (QKᵀ and PV) of 2·s·head_dim FLOPs per query, per head.
    flops = 2.0 * batch * heads * seq_len * seq_len * head_dim
    return AttentionResult(
        batch=batch,
        heads=heads,
        seq_len=seq_len,
        head_dim=head_dim,
        dtype=dtype,
        forward_s=fwd_s,
        backward_s=bwd_s,
        forward_flops=flops,
        forward_tflops=flops / fwd_s / 1e12,
        backward_over_forward=bwd_s / fwd_s,
    )


def bandwidth(timer: Timer, op: str, elements: int, dtype: str, budget_s: float) -> BandwidthResult:
    """`copy` (b.copy_(a): read 1, write 1) or `add` (torch.add(a, b, out=c): read 2, write 1)."""
    import torch

    dt = torch_dtype(dtype)
    a = torch.rand(elements, device=timer.device, dtype=dt)
    b = torch.rand(elements, device=timer.device, dtype=dt)
    c = torch.empty_like(a)
    fn = (lambda: b.copy_(a)) if op == "copy" else (lambda: torch.add(a, b, out=c))
    seconds, _ = timer.median_s(fn, budget_s)
    moved = (2 if op == "copy" else 3) * elements * a.element_size()
    return BandwidthResult(
        op=op,
        elements=elements,
        dtype=dtype,
        bytes_moved=moved,
        seconds=seconds,
        gb_per_s=moved / seconds / 1e9,
    )


def launch(timer: Timer, ops: int, budget_s: float) -> LaunchResult:
    """A chain of `ops` multiplies of one-element tensors: the time is all dispatch, autograd and launch.

    With autograd, y = y·w costs one forward kernel and two backward kernels (grad wrt y and wrt w), as
    the cost model counts kernels (KERNELS_PER_LAYER_FORWARD, and twice that in backward)."""
    import torch

    x = torch.ones(1, device=timer.device)
    w = torch.full((1,), 1.0001, device=timer.device, requires_grad=True)

    def chain_no_grad() -> None:
        with torch.no_grad():
            y = x
            for _ in range(ops):
                y = y * w

    def chain_autograd() -> None:
        y = x
        for _ in range(ops):
            y = y * w
        y.backward()
        w.grad = None

    no_grad_s, _ = timer.median_s(chain_no_grad, budget_s / 3)
    autograd_s, _ = timer.median_s(chain_autograd, 2 * budget_s / 3)
    return LaunchResult(
        ops=ops, no_grad_us_per_op=no_grad_s / ops * 1e6, autograd_us_per_kernel=autograd_s / (3 * ops) * 1e6
    )


def adam(params: int, budget_s: float) -> AdamResult:
    """One AdamW step over `params` fp32 host parameters (gradients present), with torch's fastest CPU
    variant here: fused where this torch has it, else foreach."""
    import torch

    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params) * 1e-3
    try:
        optimizer = torch.optim.AdamW([p], lr=1e-4, fused=True)
        optimizer.step()
        impl = "fused"
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW([p], lr=1e-4, foreach=True)
        impl = "foreach"
    seconds, _ = Timer("cpu").median_s(optimizer.step, budget_s)
    return AdamResult(
        params=params,
        impl=impl,
        threads=torch.get_num_threads(),
        seconds=seconds,
        gparams_per_s=params / seconds / 1e9,
    )
