"""`python -m service train EXPERIMENT.yaml [--plan selected|LABEL] [--steps N] [--storage-path DIR]
[--checkpoint-every N] [--max-failures K] [--weights CKPT [--data FILES] [--text-field NAME]
[--eval-fraction F] [--eval-every N]] [--json]`

The production run: Ray Train runs the chosen plan (default: the planner's selection; a label as
`service plan` prints it) at full scale with the proxies' worker, checkpointing to DIR (default
$SERVICE_STORAGE_PATH, else <repo>/ray_results/production; on a cluster, its shared storage) and
resuming from the latest checkpoint after a lost worker or node, up to K times. It checkpoints after
the last step and every N steps (default: Young's interval over the predicted step time, the memo's
goodput section). It trains the experiment's model from random initialisation on the proxy section's
`data` (seeded synthetic tokens by default, or a file of token ids): it proves the layout, memory and
speed at full scale. With `--weights CKPT` (a local Hugging Face checkpoint folder whose config.json
matches the experiment's model, with its tokenizer) it fine-tunes those weights instead (ZeRO-3
partitions them at load, tp and pp ranks read only their slices and layers, cp ranks the whole model), on
`--data` (local JSON-lines, Parquet or Arrow files with a `text` field or prompt/completion pairs, the loss
on the completion only), holding out
`--eval-fraction` of the packed sequences for an evaluation loss every `--eval-every` steps and at the
end, and writes the trained weights in Hugging Face format to <storage>/<run>/hf_model/. The MLflow
run's `init` tag is `random` or the checkpoint folder. The driver logs every
step to MLflow and shows one progress line on stderr. On a CPU machine it runs the tiny experiment at
its own full scale. Exit 0 when the run finished, 1 when it failed, 2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import sys

from service.cli.args import finite_float, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("experiment", help="Experiment YAML.")
    parser.add_argument("--plan", default="selected", help="'selected' (default) or a plan label.")
    parser.add_argument("--steps", type=int, help="Optimizer steps (default: the workload's).")
    parser.add_argument(
        "--storage-path",
        help="Checkpoints and step log, a shared folder (default: $SERVICE_STORAGE_PATH/production when that "
        "is set, else ray_results/production).",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_int,
        metavar="N",
        help="Steps between checkpoints (default: Young's interval; the last step is always saved).",
    )
    parser.add_argument("--max-failures", type=int, default=3, help="Restarts after a lost worker/node.")
    parser.add_argument(
        "--weights", metavar="DIR", help="Hugging Face checkpoint folder to fine-tune (default: random init)."
    )
    parser.add_argument(
        "--data", metavar="FILES", help="With --weights: JSON-lines/Parquet/Arrow file(s), glob or folder."
    )
    parser.add_argument("--text-field", default="text", help="The data's text field (default: text).")
    parser.add_argument(
        "--eval-fraction",
        type=finite_float,
        default=0.05,
        metavar="F",
        help="Share of the packed sequences held out for evaluation (default 0.05).",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="N",
        help="Steps between evaluations (default: at the end).",
    )
    parser.add_argument("--json", action="store_true", help="Print one JSON document on stdout.")


def run(args: argparse.Namespace) -> int:
    from service.cli.stdio import library_output_to_stderr, print_json
    from service.train.production import ProductionRun

    production = ProductionRun(
        args.experiment,
        args.plan,
        steps=args.steps,
        storage_path=args.storage_path,
        checkpoint_every=args.checkpoint_every,
        max_failures=args.max_failures,
        progress=True,
        weights=args.weights,
        data=args.data,
        text_field=args.text_field,
        eval_fraction=args.eval_fraction,
        eval_every=args.eval_every,
    )
    with library_output_to_stderr():
        result = production.fit()
    summary = {
        "plan": result.plan.short(),
        "status": result.status,
        "reason": result.reason,
        "steps": result.steps,
        "final_loss": result.losses[-1] if result.losses else None,
        "restarts": result.restarts,
        "run_dir": result.run_dir,
        "mlflow_run_id": result.mlflow_run_id,
        "wall_s": round(result.wall_s, 1),
    }
    if args.weights:
        last_eval = result.eval_losses[max(result.eval_losses)] if result.eval_losses else None
        summary.update({"init": args.weights, "eval_loss": last_eval, "hf_model": result.hf_model_dir})
    if args.json:
        print_json(summary)
    else:
        print(" ".join(f"{k}={v}" for k, v in summary.items() if v not in (None, "")))
    if result.status != "ok":
        print(f"error: {result.reason}", file=sys.stderr)
        return 1
    return 0
