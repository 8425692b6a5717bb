"""`python -m service proxy-run EXPERIMENT.yaml --tp T --pp P --zero Z [--ep E] ...`: one proxy trial on Ray.

Runs on the Ray cluster at `--address` / `RAY_ADDRESS`, else on a local Ray started on 127.0.0.1.
dp = workers / (tp·pp). Prints measured next to predicted, or the whole result as JSON with `--json`.
Exit status: 0 when the trial ran (`ok`), 1 for `oom` or `failed` (the reason is printed), 2 for bad
input, a layout the proxy cannot run included (`invalid`: one line on stderr naming the field; with
--json the `invalid` result document is printed on stdout too).
"""

from __future__ import annotations

import argparse
import os
from typing import get_args

from pydantic import ValidationError

from service.cli.args import positive_int
from service.spec.errors import SpecError, from_validation_error
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.plan import Plan, Precision, Recompute, ZeroStage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="experiment YAML (its proxy section sets the scale)")
    parser.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel degree")
    parser.add_argument("--pp", type=positive_int, required=True, help="pipeline stages")
    parser.add_argument("--zero", type=int, required=True, choices=get_args(ZeroStage), help="ZeRO stage")
    parser.add_argument(
        "--ep", type=positive_int, default=1, help="expert-parallel degree (MoE models; default 1)"
    )
    parser.add_argument("--offload-optimizer", action="store_true", help="optimizer states and step on CPU")
    parser.add_argument("--offload-params", action="store_true", help="parameters on CPU (ZeRO-3)")
    parser.add_argument(
        "--micro-batch", type=positive_int, required=True, help="sequences per micro-batch per rank"
    )
    parser.add_argument(
        "--grad-accum", type=positive_int, required=True, help="micro-batches per optimizer step"
    )
    parser.add_argument("--recompute", required=True, choices=get_args(Recompute))
    parser.add_argument(
        "--precision",
        choices=tuple(p for p in get_args(Precision) if p != "fp8"),  # proxies run no FP8 GEMMs
        default="bf16",
        help="the plan's precision (a CPU proxy computes in proxy.precision)",
    )
    parser.add_argument("--workers", type=positive_int, help="workers (default: proxy.num_workers)")
    parser.add_argument("--steps", type=positive_int, help="optimizer steps (default: proxy.steps)")
    parser.add_argument("--checkpoint-every", type=int, help="checkpoint every K steps")
    parser.add_argument("--inject-failure-at-step", type=positive_int, help="kill one worker once at step K")
    parser.add_argument("--storage-path", help="where checkpoints and the step log go (default: a temp dir)")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _plan(args: argparse.Namespace, experiment: ExperimentSpec) -> Plan | str:
    """The plan the flags describe (the library's `plan_for_point`), or why they describe none: the
    reason `run_proxy` would give (`proxy_plan_problem`), found before Ray starts."""
    from service.train.proxy_scale import plan_for_point, proxy_plan_problem

    point = {
        "tp": args.tp,
        "pp": args.pp,
        "zero_stage": args.zero,
        "ep": args.ep,
        "offload_optimizer": args.offload_optimizer,
        "offload_params": args.offload_params,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "recompute": args.recompute,
    }
    try:
        plan = plan_for_point(experiment, point, precision=args.precision)
    except ValidationError as err:
        problem = from_validation_error(err, model_cls=Plan)
        return f"{problem.field}: {problem.message}"
    return proxy_plan_problem(experiment, plan) or plan


def _print_table(result: dict) -> None:  # type: ignore[type-arg]
    print(f"status: {result['status']}" + (f" ({result['reason']})" if result["reason"] else ""))
    print(f"plan: {Plan.model_validate(result['plan']).short()}   restarts: {result['restarts']}")
    if result["losses"]:
        print("losses: " + " ".join(f"{x:.4f}" for x in result["losses"]))
    keys = (
        "tokens_per_s",
        "step_time_s",
        "model_state_bytes_per_rank",
        "expert_state_bytes_per_rank",
        "activation_bytes_per_rank",
        "peak_memory_bytes_per_rank",
        "moe_load",
    )
    print(f"{'':30s} {'measured':>14s} {'predicted':>14s}")
    for k in keys:
        m, p = result["measured"].get(k), result["predicted"].get(k)
        if m is None and p is None:  # the experts' share and load: MoE models only
            continue
        print(f"{k:30s} {'' if m is None else f'{m:14.4g}':>14s} {'' if p is None else f'{p:14.4g}':>14s}")


def run(args: argparse.Namespace) -> int:
    from service.spec.proxy import MAX_PROXY_WORKERS

    experiment = load_experiment(args.experiment)
    if args.workers is not None and args.workers > MAX_PROXY_WORKERS:
        raise SpecError("--workers", f"{args.workers:,}; allowed: at most {MAX_PROXY_WORKERS:,}")
    warmup = experiment.proxy.warmup_steps
    if args.steps is not None and args.steps <= warmup:
        raise SpecError(
            "--steps", f"{args.steps} leaves no timed step after proxy.warmup_steps {warmup}; allowed: more"
        )
    if args.checkpoint_every is not None and args.checkpoint_every < 0:
        raise SpecError("--checkpoint-every", f"must be 0 (never) or more, got {args.checkpoint_every}")
    workers = args.workers or experiment.proxy.num_workers
    if workers != experiment.proxy.num_workers:
        proxy = experiment.proxy.model_copy(update={"num_workers": workers})
        experiment = experiment.model_copy(update={"proxy": proxy})
    if args.address:
        os.environ["RAY_ADDRESS"] = args.address
    plan = _plan(args, experiment)
    from service.cli.stdio import library_output_to_stderr, print_json
    from service.train.proxy_trial import ProxyResult, run_proxy

    if isinstance(plan, str):  # bad input like any other: exit 2, one line naming the field
        if args.json:
            print_json(ProxyResult.invalid(plan).model_dump(mode="json"), indent=None)
        field, _, message = plan.partition(": ")
        if not message:  # proxy_plan_problem's worker count: dp·tp·pp = N but the proxy has M workers
            field, message = "--workers", plan
        raise SpecError(field, message)

    # Ray prints on stdout when a worker dies (e.g. with --inject-failure-at-step): keep stdout ours.
    with library_output_to_stderr():
        outcome = run_proxy(
            experiment,
            plan,
            steps=args.steps,
            checkpoint_every=args.checkpoint_every,
            inject_failure_at_step=args.inject_failure_at_step,
            storage_path=args.storage_path,
        )
    data = outcome.model_dump(mode="json")
    if args.json:
        print_json(data, indent=None)
    else:
        _print_table(data)
    return 0 if outcome.status == "ok" else 1
