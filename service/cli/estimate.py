"""`python -m service estimate --model M --gpu G --gpus N --tp T --pp P --zero Z ...`: one plan.

Memory per GPU by term, whether it fits, step time, tokens/s (total and per GPU) and MFU, as a table
or JSON. The global batch is micro_batch · grad_accum · dp with dp = gpus / (tp · pp · cp). Bad input
(unknown model or GPU, GPUs not a whole number of nodes, tp not dividing the heads, ...) is one line
naming the flag and what is allowed, exit 2. Imports neither torch, ray nor deepspeed.
"""

from __future__ import annotations

import argparse
from typing import Any, get_args

from service.cli.args import finite_float
from service.cli.args import positive_int as _positive_int
from service.cli.stdio import print_json
from service.spec.engine import Engine
from service.spec.plan import Precision, Recompute, ZeroStage
from service.spec.request import DEFAULT_HEADROOM
from service.spec.workload import (
    MEGATRON_DEFAULT_RECOMPUTE_MODULES,
    CudaGraphScope,
    MoEDispatcher,
    RecomputeModule,
    SelectiveRecompute,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--model",
        required=True,
        help="Catalog model name (e.g. llama2-13b), a YAML file of ModelSpec fields, or a Hugging Face "
        "config.json (the file or its folder; nothing is downloaded).",
    )
    a("--gpu", required=True, help="Catalog GPU name (e.g. h100-sxm-80gb).")
    a("--gpus", type=_positive_int, required=True, help="Total GPUs (a whole number of nodes).")
    a("--gpus-per-node", type=_positive_int, default=8, help="GPUs per node (default 8).")
    a("--tp", type=_positive_int, default=1, help="Tensor-parallel degree.")
    a("--pp", type=_positive_int, default=1, help="Pipeline-parallel stages.")
    a(
        "--cp",
        type=_positive_int,
        default=1,
        help="Context-parallel degree: each sequence split over N ranks (Ulysses on deepspeed, ring "
        "attention on megatron and fsdp; default 1).",
    )
    a(
        "--ep",
        type=_positive_int,
        default=1,
        help="Expert-parallel degree (MoE models): each MoE block's experts split over N ranks (default 1).",
    )
    a(
        "--expert-tp",
        type=_positive_int,
        default=1,
        help="Tensor-parallel degree inside each expert (megatron: any; deepspeed, fsdp: 1 or --tp).",
    )
    a(
        "--ep-comm-overlap",
        action="store_true",
        help="Megatron-Core's 1F1B MoE all-to-all overlap (megatron; with pp > 1 needs --virtual-stages).",
    )
    a(
        "--moe-load-imbalance",
        type=finite_float,
        default=None,
        help="MoE, dropless router: the busiest expert's tokens over its balanced share (default 1.5).",
    )
    a(
        "--engine",
        choices=get_args(Engine),
        default="deepspeed",
        help="What runs the plan: deepspeed (default; the service runs it), or fsdp / megatron, scored "
        "analytically under their own rules.",
    )
    a(
        "--virtual-stages",
        type=_positive_int,
        default=1,
        help="Interleaved 1F1B model chunks per pipeline stage (megatron and fsdp; deepspeed runs plain "
        "1F1B; default 1).",
    )
    a("--zero", type=int, choices=get_args(ZeroStage), default=0, help="ZeRO stage.")
    a("--offload-optimizer", action="store_true", help="Optimizer states and step on CPU (ZeRO 1-3).")
    a("--offload-params", action="store_true", help="Parameters on CPU between uses (ZeRO 3).")
    a(
        "--zero-hpz",
        type=_positive_int,
        default=1,
        help="ZeRO++ hpZ: secondary parameter partition over N ranks of a node (ZeRO 3, deepspeed; 1 = off).",
    )
    a(
        "--shard-group-size",
        type=int,
        default=0,
        help="Shard groups (HSDP): ZeRO-3 shards in groups of N ranks, replicated across (fsdp; 0 = off).",
    )
    a("--zero-quantized-weights", action="store_true", help="ZeRO++ qwZ: int8 weight all-gathers.")
    a("--zero-quantized-gradients", action="store_true", help="ZeRO++ qgZ: int4 gradient reduction.")
    a("--micro-batch", type=_positive_int, default=1, help="Sequences per micro-batch per DP rank.")
    a("--grad-accum", type=_positive_int, default=1, help="Micro-batches per optimizer step.")
    a("--seq-len", type=_positive_int, default=4096, help="Tokens per sequence (default 4096).")
    a("--recompute", choices=get_args(Recompute), default="none", help="Activation recompute.")
    a("--sequence-parallel", action="store_true", help="Shard norm/dropout activations over TP (tp > 1).")
    a(
        "--comm-overlap",
        action="store_true",
        help="Megatron-Core's pipeline-send, gradient-reduce and parameter-gather overlaps (megatron).",
    )
    a(
        "--tp-comm-overlap",
        action="store_true",
        help="Megatron-Core's TE-userbuffer TP overlap (megatron, with --sequence-parallel).",
    )
    a(
        "--precision",
        choices=get_args(Precision),
        default="bf16",
        help="Compute precision (default bf16; fp8 = Transformer Engine FP8 GEMMs, GPUs with FP8 only).",
    )
    a("--no-flash-attention", action="store_true", help="Materialised attention scores (Megatron 2021-22).")
    a(
        "--no-cudnn-attention",
        action="store_true",
        help="FlashAttention-2 instead of cuDNN's kernel on Hopper (torch SDPA before 2.11).",
    )
    a(
        "--fused-elementwise",
        action="store_true",
        help="Fused norm/rotary/SwiGLU kernels (Apex, TE, Liger, torch.compile); default: eager HF modules.",
    )
    a(
        "--grad-reduce-in-fp32",
        action="store_true",
        help="A megatron plan keeps and reduces fp32 gradients (Megatron-LM's bf16 default; "
        "Workload.grad_reduce_in_fp32); default: bf16, as NVIDIA's performance recipes run.",
    )
    a(
        "--fused-cross-entropy",
        action="store_true",
        help="The loss keeps no logits (Liger's fused linear cross-entropy); default: materialised logits.",
    )
    a(
        "--selective-recompute",
        choices=get_args(SelectiveRecompute),
        default="attention_block",
        help="What --recompute selective checkpoints: the attention sub-block (default, this service's "
        "worker), every second block or torchtitan's op policy (Workload.selective_recompute).",
    )
    a(
        "--recompute-modules",
        nargs="+",
        choices=get_args(RecomputeModule),
        default=list(MEGATRON_DEFAULT_RECOMPUTE_MODULES),
        metavar="MODULE",
        help="What a megatron plan's --recompute selective re-runs, Megatron-Core's --recompute-modules "
        f"(Workload.recompute_modules; default core_attn): {', '.join(get_args(RecomputeModule))}.",
    )
    a(
        "--moe-dispatcher",
        choices=get_args(MoEDispatcher),
        default="alltoall",
        help="How a megatron plan's MoE blocks send tokens (Workload.moe_dispatcher): NCCL's all-to-all "
        "of every routed copy, or DeepEP's (or HybridEP's) once per remote node.",
    )
    a(
        "--cuda-graph-scope",
        nargs="*",
        choices=get_args(CudaGraphScope),
        default=[],
        metavar="SCOPE",
        help="What a megatron plan replays from CUDA graphs, Megatron-Core's --cuda-graph-scope "
        f"(Workload.cuda_graph_scope; default none: eager): {', '.join(get_args(CudaGraphScope))}.",
    )
    a(
        "--tokens-to-train",
        type=finite_float,
        default=1e9,
        help="Tokens the run trains, for hours and dollars (1e9).",
    )
    a(
        "--headroom",
        type=finite_float,
        default=DEFAULT_HEADROOM,
        help="Fraction of GPU memory kept free (default 0.10).",
    )
    a(
        "--price-per-gpu-hour",
        type=finite_float,
        default=None,
        help="USD per GPU-hour (default: the GPU catalog's).",
    )
    a(
        "--inter-node-bandwidth",
        type=finite_float,
        default=None,
        help="Network line rate per GPU between nodes, GB/s (default: the GPU catalog's; 800 Gb/s per "
        "8-GPU node is 12.5).",
    )
    a("--params", default=None, help="Cost-model parameter set (YAML; default: the shipped set).")
    a("--json", action="store_true", help="Print JSON instead of a table.")


# A request field whose flag is not `--` + the field with dashes.
NEGATED_FLAGS = {"flash_attention": "--no-flash-attention", "cudnn_attention": "--no-cudnn-attention"}


def flag_of(field: str) -> str:
    """The flag that sets `PlanRequest.field`."""
    return NEGATED_FLAGS.get(field, "--" + field.replace("_", "-"))


def build(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(model, cluster, plan, workload) from the flags through `PlanRequest`; `SpecError` naming the
    flag on bad input."""
    from service.spec import SpecError
    from service.spec.errors import validate_as
    from service.spec.request import PlanRequest

    given = {name: getattr(args, name) for name in PlanRequest.model_fields if hasattr(args, name)}
    given |= {
        "flash_attention": not args.no_flash_attention,
        "cudnn_attention": not args.no_cudnn_attention,
        "recompute_modules": tuple(args.recompute_modules),
        "cuda_graph_scope": tuple(args.cuda_graph_scope),
    }
    try:
        return validate_as(PlanRequest, given).resolve()
    except SpecError as err:
        if err.source:  # the problem sits in a file the flag named (a model YAML, a config.json)
            raise
        raise SpecError(flag_of(err.field.split(".")[0]), err.message) from None


def run(args: argparse.Namespace) -> int:
    from service.planner import estimate_plan
    from service.spec.params import load_params

    model, cluster, plan, workload = build(args)
    params = load_params(args.params)
    est = estimate_plan(model, cluster, plan, workload, memory_headroom=args.headroom, params=params)
    inputs = {
        "model": model.name,
        "gpu": cluster.gpu.name,
        "num_gpus": cluster.num_gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "seq_len": workload.seq_len,
        "global_batch_sequences": workload.batch_sequences,
        "tokens_to_train": workload.tokens_to_train,
        "flash_attention": workload.flash_attention,
        "cudnn_attention": workload.cudnn_attention,
        "fused_elementwise": workload.fused_elementwise,
        "fused_cross_entropy": workload.fused_cross_entropy,
        "selective_recompute": workload.selective_recompute,
        "recompute_modules": list(workload.recompute_modules),
        "moe_dispatcher": workload.moe_dispatcher,
        "cuda_graph_scope": list(workload.cuda_graph_scope),
        "grad_reduce_in_fp32": workload.grad_reduce_in_fp32,
        "memory_headroom": args.headroom,
    }
    if model.moe is not None:
        inputs |= {
            "total_params": model.num_params,
            "active_params": model.active_params,
            "moe_load_imbalance": workload.moe_load_imbalance,
            "router": model.moe.router,
        }
    if args.json:
        print_json({"label": plan.short(), "inputs": inputs, **est.model_dump()})
    else:
        print(render(est, inputs))
    return 0


def render(est: Any, inputs: dict[str, Any]) -> str:
    from service.cli.plan import format_table, memory_lines, span

    times = est.time_breakdown_s.model_dump()
    fits = "fits" if est.fits else "DOES NOT FIT"
    return "\n".join(
        [
            f"{est.plan.short()}: {inputs['model']} on {inputs['num_gpus']} × {inputs['gpu']}, "
            f"{inputs['seq_len']}-token sequences, {inputs['global_batch_sequences']} per step",
            "",
            f"memory per GPU (GiB): {fits}",
            memory_lines(est.memory_per_gpu_bytes.model_dump(), est.memory_limit_bytes),
            "",
            f"step time {est.step_time_s:.3f} s, by term after overlap (s):",
            format_table(list(times), [[f"{v:.3f}" for v in times.values()]], left=0),
            "",
            f"{est.tokens_per_s:,.0f} tokens/s ({est.tokens_per_s_per_gpu:,.0f} per GPU; "
            f"{span(est.tokens_per_s_interval, label='80 % interval ')}), "
            f"{est.model_tflops_per_gpu:.0f} model TFLOP/s per GPU, MFU {est.mfu:.1%}",
            f"{inputs['tokens_to_train']:.3g} tokens: {est.hours:,.2f} h "
            f"({span(est.hours_interval, ',.2f')}), "
            f"${est.dollars:,.0f} ({span(est.dollars_interval, ',.0f', '$')}), failure-free "
            "(`plan` and `run` add interruptions, checkpoints and restarts)",
            f"parameter set {est.params.name!r} (fit on {', '.join(est.params.fit_on) or 'nothing'}); "
            f"interval: {est.params.interval}",
        ]
    )
