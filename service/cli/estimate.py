"""`python -m service estimate --model M --gpu G --gpus N --tp T --pp P --zero Z ...`: one plan.

Memory per GPU by term, whether it fits, step time, tokens/s (total and per GPU) and MFU, as a table
or JSON. The global batch is micro_batch · grad_accum · dp with dp = gpus / (tp · pp · cp). Bad input
(unknown model or GPU, GPUs not a whole number of nodes, tp not dividing the heads, ...) is one line
naming the flag and what is allowed, exit 2. Imports neither torch, ray nor deepspeed.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, get_args

from service.cli.args import finite_float
from service.cli.args import positive_int as _positive_int
from service.spec.engine import Engine
from service.spec.plan import Precision, Recompute, ZeroStage
from service.spec.workload import (
    MEGATRON_DEFAULT_RECOMPUTE_MODULES,
    MoEDispatcher,
    RecomputeModule,
    SelectiveRecompute,
)

# plan_problem's field -> the flag a user of this command would change.
FLAGS = {
    "dp": "--gpus",
    "tp": "--tp",
    "pp": "--pp",
    "zero_stage": "--zero",
    "offload_optimizer": "--offload-optimizer",
    "offload_params": "--offload-params",
    "sequence_parallel": "--sequence-parallel",
    "micro_batch": "--micro-batch",
    "grad_accum": "--grad-accum",
    "virtual_stages": "--virtual-stages",
    "engine": "--engine",
    "precision": "--precision",
    "cp": "--cp",
    "zero_hpz_partition_size": "--zero-hpz",
    "shard_group_size": "--shard-group-size",
    "zero_quantized_weights": "--zero-quantized-weights",
    "zero_quantized_gradients": "--zero-quantized-gradients",
    "comm_overlap": "--comm-overlap",
    "tp_comm_overlap": "--tp-comm-overlap",
    "ep": "--ep",
    "ep_comm_overlap": "--ep-comm-overlap",
    "expert_tp": "--expert-tp",
    "moe_load_imbalance": "--moe-load-imbalance",
}


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
        "of every routed copy, or DeepEP's once per remote node.",
    )
    a(
        "--tokens-to-train",
        type=finite_float,
        default=1e9,
        help="Tokens the run trains, for hours and dollars (1e9).",
    )
    a("--headroom", type=finite_float, default=0.10, help="Fraction of GPU memory kept free (default 0.10).")
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


def _flag_error(flag: str, err: Exception) -> Exception:
    from service.spec import SpecError

    message = err.message if isinstance(err, SpecError) else str(err)
    return SpecError(flag, message) if not getattr(err, "source", None) else err


def _allowed(field: str, values: dict[str, Any], model: Any, cluster: Any) -> str:
    """The values of `field` that would pass, other flags unchanged ('' when not a layout field)."""
    from service.spec.plan import Plan, allowed_values

    if field not in ("tp", "pp", "cp"):
        return ""
    ok = allowed_values(field, Plan.model_construct(**values), model, cluster)
    return f"; allowed {FLAGS[field]} for this model and cluster: {', '.join(map(str, ok)) or 'none'}"


def build(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(model, cluster, plan, workload) from the flags; `SpecError` naming the flag on bad input."""
    from service.catalog import load_gpu, load_model
    from service.spec import ClusterSpec, Plan, SpecError, Workload, plan_problem
    from service.spec.errors import validate_as
    from service.spec.hardware import MAX_GPUS
    from service.spec.workload import MAX_SEQ_LEN

    if args.gpus > MAX_GPUS:
        raise SpecError("--gpus", f"{args.gpus:,} GPUs; allowed: at most {MAX_GPUS:,}")
    if args.seq_len > MAX_SEQ_LEN:
        raise SpecError("--seq-len", f"{args.seq_len:,} tokens; allowed: at most {MAX_SEQ_LEN:,}")

    try:
        model = load_model(args.model)
    except SpecError as err:
        raise _flag_error("--model", err) from None
    try:
        gpu = load_gpu(args.gpu)
        cluster = ClusterSpec.from_gpu_count(gpu, args.gpus, args.gpus_per_node)
    except SpecError as err:
        raise _flag_error("--gpu", err) from None
    except ValueError as err:
        raise SpecError("--gpus", f"{err}; allowed: a multiple of {args.gpus_per_node}, or fewer") from None
    if args.price_per_gpu_hour is not None:
        if args.price_per_gpu_hour < 0:
            raise SpecError("--price-per-gpu-hour", f"must be 0 or more, got {args.price_per_gpu_hour}")
        cluster = cluster.model_copy(update={"price_per_gpu_hour_usd": args.price_per_gpu_hour})
    if args.inter_node_bandwidth is not None:
        if args.inter_node_bandwidth <= 0:
            raise SpecError(
                "--inter-node-bandwidth", f"must be more than 0 GB/s, got {args.inter_node_bandwidth}"
            )
        # Validated, not model_copy'd: the validator carries the rate into the GPU spec the model reads.
        update = {"inter_node_bandwidth_gb_per_s": args.inter_node_bandwidth}
        cluster = ClusterSpec.model_validate({**cluster.model_dump(), **update})
    values = dict(
        dp=max(1, args.gpus // (args.tp * args.pp * args.cp)), tp=args.tp, pp=args.pp, cp=args.cp,
        zero_stage=args.zero,
        offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
        micro_batch=args.micro_batch, grad_accum=args.grad_accum, recompute=args.recompute,
        sequence_parallel=args.sequence_parallel, precision=args.precision,
        virtual_stages=args.virtual_stages, engine=args.engine,
        zero_hpz_partition_size=args.zero_hpz, shard_group_size=args.shard_group_size,
        zero_quantized_weights=args.zero_quantized_weights,
        zero_quantized_gradients=args.zero_quantized_gradients,
        comm_overlap=args.comm_overlap, tp_comm_overlap=args.tp_comm_overlap,
        ep=args.ep, expert_tp=args.expert_tp, ep_comm_overlap=args.ep_comm_overlap,
    )  # fmt: skip
    if args.gpus % (args.tp * args.pp * args.cp):
        field = "pp" if args.gpus % args.pp else "cp" if args.gpus % args.cp else "tp"
        message = f"tp·pp·cp = {args.tp * args.pp * args.cp} does not divide --gpus {args.gpus}"
        raise SpecError(FLAGS[field], message + _allowed(field, values, model, cluster))
    if args.shard_group_size < 0:
        raise SpecError("--shard-group-size", f"must be 0 (off) or more, got {args.shard_group_size}")
    if not 0 <= args.headroom < 1:
        raise SpecError("--headroom", f"must be in [0, 1), got {args.headroom}")
    if args.tokens_to_train <= 0:
        raise SpecError("--tokens-to-train", f"must be positive, got {args.tokens_to_train:g}")
    batch = args.micro_batch * args.grad_accum * values["dp"]
    if args.tokens_to_train < batch * args.seq_len:
        # Less than one step: the hours would be a fraction of the step time printed beside them.
        raise SpecError(
            "--tokens-to-train",
            f"{args.tokens_to_train:g} is less than one optimizer step: --micro-batch × --grad-accum × dp × "
            f"--seq-len = {batch * args.seq_len:,} tokens (dp {values['dp']} from --gpus); allowed: at "
            "least that many",
        )
    data = dict(
        seq_len=args.seq_len,
        global_batch_sequences=batch,
        tokens_to_train=args.tokens_to_train,
        flash_attention=not args.no_flash_attention,
        cudnn_attention=not args.no_cudnn_attention,
        fused_elementwise=args.fused_elementwise,
        selective_recompute=args.selective_recompute,
        recompute_modules=tuple(args.recompute_modules),
        moe_dispatcher=args.moe_dispatcher,
    )
    if args.moe_load_imbalance is not None:
        data["moe_load_imbalance"] = args.moe_load_imbalance
    try:
        workload = validate_as(Workload, data)
    except SpecError as err:
        flag = {"global_batch_sequences": "--micro-batch"}.get(err.field, f"--{err.field.replace('_', '-')}")
        raise SpecError(flag, err.message) from None
    megatron_modules = set(workload.recompute_modules) != set(MEGATRON_DEFAULT_RECOMPUTE_MODULES)
    if megatron_modules and args.engine != "megatron":
        raise SpecError(
            "--recompute-modules",
            f"{' '.join(workload.recompute_modules)} is Megatron-Core's selective recompute and the plan's "
            f"engine is {args.engine}; allowed: core_attn (the default), or --engine megatron",
        )
    if workload.moe_dispatcher != "alltoall" and args.engine != "megatron":
        raise SpecError(
            "--moe-dispatcher",
            f"{workload.moe_dispatcher} is Megatron-Core's flex dispatcher and the plan's engine is "
            f"{args.engine}; allowed: alltoall (the default), or --engine megatron",
        )
    problem = plan_problem(Plan.model_construct(**values), model, cluster, workload)
    if problem:
        field, message = problem
        raise SpecError(FLAGS.get(field, field), message + _allowed(field, values, model, cluster))
    return model, cluster, Plan(**values), workload


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
        "selective_recompute": workload.selective_recompute,
        "recompute_modules": list(workload.recompute_modules),
        "moe_dispatcher": workload.moe_dispatcher,
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
        print(json.dumps({"label": plan.short(), "inputs": inputs, **est.model_dump()}, indent=2))
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
            f"${est.dollars:,.0f} ({span(est.dollars_interval, ',.0f', '$')})",
            f"parameter set {est.params.name!r} (fit on {', '.join(est.params.fit_on) or 'nothing'}); "
            f"interval: {est.params.interval}",
        ]
    )
