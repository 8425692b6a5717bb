"""The host's time for one pass (forward and backward) through DeepSpeed's MoE layer, the proxies' engine,
by experts per rank: measured on this machine's CPU with tensors so small that the arithmetic is
negligible, what is left is the Python and dispatch work of the gate, the dispatch, DeepSpeed's loop over
its local experts and the combine. A GPU host runs the same Python and adds a CUDA launch per kernel, so
these are a floor for DeepSpeed's host time per MoE block pass there. The cost model's
`moe_block_host_s` (9.7 ms, constant per block) is fit on Megatron-Core runs (benchmarks/moe_accuracy.py)
and applied to DeepSpeed plans too: this says how far that holds.

In-run baseline: a dense SwiGLU MLP of the same width through the same forward and backward.

    python benchmarks/moe_host_time.py   # ~30 s; --out benchmarks/results/moe_host_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "results" / "moe_host_time.json"
LOCAL_EXPERTS = (4, 8, 16, 32, 64, 128)
TOP_K = 8  # Qwen3-MoE's and DeepSeek-V3's (fewer where a rank holds fewer experts)
HIDDEN, WIDTH, TOKENS = 64, 64, 16  # small enough that the arithmetic is a few µs per op


def _init_single_rank() -> None:
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    os.environ.update(env | {"MASTER_PORT": str(port)})
    deepspeed.init_distributed(dist_backend="gloo")


def _passes_s(modules: dict[str, torch.nn.Module], repeats: int) -> dict[str, float]:
    """Least seconds of forward + backward of each module on TOKENS × HIDDEN over `repeats` rounds, the
    modules taken in turn each round (so a slow spell of the machine falls on all of them), after
    warm-up rounds: noise only adds, so the least is the cost itself."""
    x = torch.randn(1, TOKENS, HIDDEN, requires_grad=True)

    def one(module: torch.nn.Module) -> float:
        start = time.perf_counter()
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
        return time.perf_counter() - start

    best = dict.fromkeys(modules, float("inf"))
    for round_ in range(repeats + 5):
        for name, module in modules.items():
            seconds = one(module)
            if round_ >= 5:
                best[name] = min(best[name], seconds)
    return best


def _mlp() -> torch.nn.Module:
    """The proxies' SwiGLU MLP (service/train/moe.py), HIDDEN in and out, WIDTH inside."""
    from service.spec.model import ModelSpec
    from service.train import moe
    from service.train.model import llama_config

    spec = ModelSpec(name="host-probe", num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                     ffn_hidden_size=WIDTH, vocab_size=128)  # fmt: skip
    return moe._mlp(llama_config(spec), WIDTH)


def _moe(local: int) -> torch.nn.Module:
    from deepspeed.moe.layer import MoE

    layer = MoE(HIDDEN, expert=_mlp(), num_experts=local, ep_size=1,
                k=min(TOP_K, local), drop_tokens=False, use_residual=False,
                top2_2nd_expert_sampling=False)  # fmt: skip
    layer.set_deepspeed_parallelism()
    return layer


def measure(repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _init_single_rank()
    modules = {"dense": _mlp()} | {str(k): _moe(k) for k in LOCAL_EXPERTS}
    best = _passes_s(modules, repeats)
    dense_s, passes = best.pop("dense"), {int(k): v for k, v in best.items()}
    slope, intercept = np.polyfit(list(passes), list(passes.values()), 1)
    return {
        "device": "cpu, one thread",
        "tokens": TOKENS,
        "hidden": HIDDEN,
        "expert_width": WIDTH,
        "top_k": TOP_K,
        "dense_mlp_pass_ms": round(dense_s * 1e3, 3),
        "moe_pass_ms": {str(k): round(v * 1e3, 3) for k, v in passes.items()},
        "moe_over_dense": {str(k): round(v / dense_s, 1) for k, v in passes.items()},
        "fit_ms": {"per_block": round(intercept * 1e3, 3), "per_local_expert": round(slope * 1e3, 3)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS_PATH))
    args = parser.parse_args(argv)
    result = measure(args.repeats)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"dense MLP pass: {result['dense_mlp_pass_ms']} ms")
    for k, ms in result["moe_pass_ms"].items():
        print(f"MoE pass, {k} local experts: {ms} ms ({result['moe_over_dense'][k]}x the dense MLP)")
    fit = result["fit_ms"]
    print(f"fit: {fit['per_block']} ms per block + {fit['per_local_expert']} ms per local expert")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
