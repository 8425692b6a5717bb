"""`python -m service profile [--json] [--out PATH] [--model NAME] [--budget-s N] [--write-catalog NAME]`.

Times this machine's device (CUDA if present, else the CPU as one proxy worker sees it) over a model's
matmul shapes, causal attention, element-wise bandwidth, per-op overhead and an Adam step; writes the
profile (measurements and the GPU catalog fields derived from them) to `--out`, and with
`--write-catalog NAME` a catalog entry `service/catalog/gpus/NAME.yaml`: the base entry with the
measured fields laid over it. `--json` prints exactly one JSON document.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from service.cli.args import finite_float, output_path
from service.cli.stdio import print_json

DEFAULT_BUDGET_S = {"cpu": 60.0, "cuda": 180.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model", help="Catalog model name or ModelSpec YAML whose shapes are timed (default llama2-13b)."
    )
    model.add_argument(
        "--experiment", help="Experiment YAML: time its proxy model at its proxy sequence length instead."
    )
    a("--budget-s", type=finite_float, help="Time budget in seconds (default 60 on CPU, 180 on CUDA).")
    a("--device", choices=("cpu", "cuda"), help="Device to profile (default: cuda if present, else cpu).")
    a("--threads", type=int, help="CPU: torch threads, as one proxy worker has (default 1).")
    a(
        "--workers",
        type=int,
        default=2,
        help="CPU: time gloo all-reduce among N processes (0: skip; default 2).",
    )
    a("--base-gpu", help="Catalog entry the measured fields override (default: this device's).")
    a("--out", help="Profile YAML to write (default profile-<base-gpu>.yaml).")
    a("--write-catalog", metavar="NAME", help="Also write service/catalog/gpus/NAME.yaml from the profile.")
    a("--json", action="store_true", help="Print the profile as one JSON document.")


def _model_and_seq_len(args: argparse.Namespace) -> tuple[Any, int | None]:
    from service.catalog import load_model

    if args.experiment:
        from service.spec import load_experiment
        from service.train.proxy_scale import proxy_model, proxy_seq_len

        experiment = load_experiment(args.experiment)
        return proxy_model(experiment), proxy_seq_len(experiment)
    return load_model(args.model or "llama2-13b"), None


def run(args: argparse.Namespace) -> int:
    from service.profile import catalog, default_config, run_profile
    from service.profile.profiler import detect_device
    from service.spec.errors import SpecError

    if args.out is not None:
        output_path("--out", args.out)  # before the measurements, which take minutes

    if args.budget_s is not None and not args.budget_s > 0:
        raise SpecError("--budget-s", f"must be positive seconds, got {args.budget_s:g}")
    if args.threads is not None and args.threads <= 0:
        raise SpecError("--threads", f"must be a positive integer, got {args.threads}")
    if args.workers < 0 or args.workers == 1:
        raise SpecError("--workers", f"must be 0 (skip) or at least 2 processes, got {args.workers}")
    model, seq_len = _model_and_seq_len(args)
    device = args.device or detect_device()
    if device == "cuda" and detect_device() != "cuda":
        raise SpecError("--device", "cuda: no CUDA device on this machine; allowed: cpu")
    config = replace(
        default_config(device, seq_len=seq_len, threads=args.threads), collective_workers=args.workers
    )
    budget_s = args.budget_s or DEFAULT_BUDGET_S[device]
    profile = run_profile(model, budget_s, device, base_gpu=args.base_gpu, config=config)
    out = profile.save(args.out or f"profile-{profile.base_gpu}.yaml")
    entry = None
    if args.write_catalog:
        entry = catalog.write_catalog_entry(profile, args.write_catalog, catalog.CATALOG_GPUS)
    if args.json:
        doc = {"profile_path": str(out), "catalog_entry_path": entry and str(entry)}
        print_json({**doc, **profile.model_dump(mode="json")})
    else:
        print(render(profile))
        print(f"wrote {out}" + (f" and {entry}" if entry else ""))
    return 0


def render(profile: Any) -> str:
    d = profile.device
    best = max((g for g in profile.gemm if g.dtype == profile.dtype), key=lambda g: g.tflops, default=None)
    lines = [
        f"{d.kind} {d.name} ({d.threads} {'threads' if d.kind == 'cpu' else 'SMs'}), "
        f"torch {d.torch_version}, "
        f"{profile.model} shapes in {profile.dtype}, {profile.wall_s:.0f} s",
        f"  matmuls timed: {len(profile.gemm)}"
        + (f", best {best.tflops * 1e3:,.1f} GFLOP/s at {best.m}×{best.n}×{best.k}" if best else ""),
    ]
    lines += [
        f"  attention s={a.seq_len} d={a.head_dim}: forward {a.forward_s * 1e3:.3f} ms "
        f"({a.forward_tflops * 1e3:,.1f} GFLOP/s), backward ×{a.backward_over_forward:.1f}"
        for a in profile.attention
    ]
    lines += [f"  {b.op}: {b.gb_per_s:.1f} GB/s" for b in profile.bandwidth]
    lines.append(
        f"  per op: {profile.launch.no_grad_us_per_op:.1f} µs (no grad), "
        f"{profile.launch.autograd_us_per_kernel:.1f} µs per kernel with autograd"
    )
    if profile.adam:
        lines.append(f"  AdamW ({profile.adam.impl}): {profile.adam.gparams_per_s:.3f} Gparam/s")
    lines += [
        f"  {c.backend} {c.op} ×{c.world}, {c.bytes:,} bytes: {c.seconds * 1e6:,.0f} µs"
        for c in profile.collectives
    ]
    lines.append(f"catalog fields for {profile.base_gpu}:")
    lines += [f"  {k}: {v:g}" for k, v in profile.overrides.items()]
    return "\n".join(lines)
