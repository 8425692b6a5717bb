"""What a run leaves behind: the production DeepSpeed config, the launch command, the MLflow parent run.

The DeepSpeed config comes from the proxies' own builder (service/train/ds_config.py), so production
runs exactly the layout the proxies ran, at full scale: the plan's precision, ZeRO stage, offload,
batch split and tensor-parallel degree; communication overlap on (the cost model hides DP communication
behind compute, which DeepSpeed only does with `overlap_comm`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from service.report.result import RunResult
from service.spec.experiment import ExperimentSpec
from service.spec.hardware import ClusterSpec
from service.spec.model import ModelSpec
from service.spec.plan import Plan
from service.spec.proxy import ProxySpec


def production_ds_config(plan: Plan, experiment: ExperimentSpec) -> dict[str, Any]:
    """The DeepSpeed config of `plan` on the production cluster (a CUDA "proxy" of full size) with the
    production settings `service train`'s workers run with (train.ds_config.production_settings)."""
    from service.train.ds_config import deepspeed_config, production_settings, with_settings

    # A CUDA config computes in the plan's precision (ds_config.proxy_precision); an FP8 plan's DeepSpeed
    # precision is bf16 (ProxySpec names only what DeepSpeed itself runs).
    precision = "bf16" if plan.precision == "fp8" else plan.precision
    proxy = ProxySpec(device="cuda", precision=precision, seed=experiment.proxy.seed)
    config = deepspeed_config(plan, proxy, experiment.model)
    return with_settings(config, production_settings(experiment, int(experiment.workload.steps_to_train)))


def ray_job_command(experiment_path: str, plan: Plan) -> str:
    """The plan at full scale as a Ray job: `python -m service train` runs the proxies' own worker (Ray
    Train + DeepSpeed, checkpoints, restarts) on the experiment's cluster; `service submit` is
    `ray job submit --working-dir .` that passes the MLflow and storage settings on."""
    train = ["python", "-m", "service", "train", experiment_path, "--plan", plan.short()]
    return shlex.join(["python", "-m", "service", "submit", "--", *train])


def offers_service_train(
    spec: ExperimentSpec, cluster: ClusterSpec, experiment_path: str | None, plan: Plan
) -> bool:
    """Whether the launch is a `service train` job: it runs the experiment's own cluster (offered when
    that cluster was chosen), keeps the logits, so not for a workload priced with a fused loss
    (`Workload.fused_cross_entropy`, which `train` refuses), and builds the plan's layout
    (train.production.trainer_problem); otherwise the launch is the user's own script's."""
    from service.train.production import trainer_problem

    same_cluster = cluster == spec.cluster and experiment_path is not None
    runnable = trainer_problem(spec, plan) is None
    return same_cluster and not spec.workload.fused_cross_entropy and runnable


def launch_command(plan: Plan, cluster: ClusterSpec, ds_config_path: Path) -> str:
    """DeepSpeed's launcher over the cluster's nodes, with the generated config.

    `train.py` stands for the user's training script (it must call `deepspeed.initialize` with
    `config=<this file>`; with pp > 1 it wraps the model in `deepspeed.pipe.PipelineModule(
    num_stages=pp)`, as service/train/worker.py does for the proxies).
    """
    args = [
        "deepspeed",
        "--hostfile=hostfile",
        f"--num_nodes={cluster.num_nodes}",
        f"--num_gpus={cluster.gpus_per_node}",
        "train.py",
        "--deepspeed",
        f"--deepspeed_config={ds_config_path}",
    ]
    return shlex.join(args)


# `service train` without --weights trains the plan from random initialisation on the experiment's
# proxy.data tokens (a proof of layout, memory and speed): the script runs that only when asked to.
TRAIN_JOB_GUARD = """\
# Fine-tune: WEIGHTS=/path/to/hf-checkpoint DATA='/path/to/train-*.jsonl' ./launch.sh
# Smoke test of the layout from random initialisation instead: SMOKE_TEST=1 [STEPS=20] ./launch.sh
if [[ -n "${WEIGHTS:-}" ]]; then
  : "${DATA:?set DATA to your training files (JSON lines, Parquet or Arrow)}"
  extra=(--weights "$WEIGHTS" --data "$DATA")
elif [[ "${SMOKE_TEST:-}" == 1 ]]; then
  extra=(--steps "${STEPS:-20}")
else
  echo "launch.sh: set WEIGHTS and DATA to fine-tune your checkpoint, or SMOKE_TEST=1 for a short run" >&2
  exit 2
fi
"""


# A mixture of experts: this service's trainer loads no MoE checkpoint (train/checkpoint_checks.py), so
# its job proves the layout from random initialisation and the real run is the user's own script.
MOE_TRAIN_JOB_GUARD = """\
# This service's trainer loads no mixture-of-experts checkpoint: train with your own script (above).
# Smoke test of the layout from random initialisation: SMOKE_TEST=1 [STEPS=20] ./launch.sh
if [[ "${SMOKE_TEST:-}" == 1 ]]; then
  extra=(--steps "${STEPS:-20}")
else
  echo "launch.sh: SMOKE_TEST=1 for a short run of the layout; the training run is your own script's" >&2
  exit 2
fi
"""


def write_launch_script(
    path: Path,
    command: str,
    plan: Plan,
    cluster: ClusterSpec,
    deepspeed_command: str | None = None,
    model: ModelSpec | None = None,
    train_job: bool = False,
) -> Path:
    """`launch.sh`: `command` from the folder `run` ran in; a `service train` job (`train_job`) asks for
    the checkpoint and data to fine-tune (`TRAIN_JOB_GUARD`) rather than spend the run's budget training
    from random initialisation."""
    layout = (
        f"# train.py builds the plan's tp={plan.tp} / pp={plan.pp} / cp={plan.cp} layers and passes\n"
        "# their groups (an `mpu`, or a PipelineModule) to deepspeed.initialize:\n"
        f"# train_batch_size counts dp = {plan.dp}.\n"
        if plan.tp * plan.pp * plan.cp > 1
        else ""
    )
    layout += _moe_layer_line(model, plan)
    slots = f"'host slots={cluster.gpus_per_node}' per line"
    if deepspeed_command and deepspeed_command != command:
        alternative = (
            f"# Or with your own training script (`hostfile` lists the nodes, {slots}; train.py\n"
            "# passes --deepspeed_config to deepspeed.initialize):\n"
            f"{layout}"
            f"#   {deepspeed_command}\n"
        )
    else:  # the command is the user's own script's
        alternative = (
            f"# Your own training script, train.py (`hostfile` lists the nodes, {slots}), passes\n"
            f"# --deepspeed_config to deepspeed.initialize.\n{layout}"
        )
    body = f"{command}\n"
    if train_job:
        guard = MOE_TRAIN_JOB_GUARD if model is not None and model.moe is not None else TRAIN_JOB_GUARD
        body = guard + f'{command} "${{extra[@]}}"\n'
    path.write_text(
        "#!/usr/bin/env bash\n"
        f"# {plan.short()} on {cluster.num_nodes} x {cluster.gpus_per_node} {cluster.gpu.name}.\n"
        f"{alternative}"
        "set -euo pipefail\n"
        # The experiment's path and `submit`'s working directory are relative to where `run` ran.
        f"cd {shlex.quote(str(Path.cwd()))}\n"
        f"{body}"
    )
    path.chmod(0o755)
    return path


def open_parent_run(experiment: ExperimentSpec, key: str, run_name: str) -> tuple[Any, str | None, str]:
    """(tracker, run id, tracking URI) of the parent run `key`: the proxy search's, whose trials are its
    children, reopened; or a new run when no search ran. The id is None while the store is down (the
    records wait in the tracker's local buffer)."""
    from service.tracking.tracker import tracker_for
    from service.tracking.uri import resolve

    target = resolve(experiment.tracking, experiment.name)
    tracker = tracker_for(target)
    tracker.start_run(key, run_name, tags={"service.kind": "run"})
    return tracker, tracker.run_id(key), target.uri


def log_outputs(tracker: Any, key: str, result: RunResult, files: list[Path]) -> None:
    """Tags for the selected plan, metrics for the prediction (with its interval), memo, configs,
    plots and result as artifacts; then closes the parent run."""
    metrics: dict[str, float] = {}
    if result.predicted is not None:
        for k, figure in result.predicted.figures().items():
            metrics[f"predicted_{k}"] = figure.value
            metrics[f"predicted_{k}_low"], metrics[f"predicted_{k}_high"] = figure.interval
    plan = result.selected_plan.model_dump(mode="json") if result.selected_plan is not None else {}
    tags = {
        "run.selected_plan": result.selected_label or "none",
        "run.message": result.message[:4000],
        **{f"run.selected.{k}": v for k, v in plan.items()},
    }
    tracker.log_batch(key, metrics=metrics, tags=tags)
    for f in files:
        if f.is_file():
            tracker.log_artifact(key, f, "run/charts" if f.suffix == ".png" else "run")
    tracker.end_run(key, "FINISHED")


def dump_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def _moe_layer_line(model: ModelSpec | None, plan: Plan) -> str:
    """How train.py builds a MoE model's expert layers for this plan: DeepSpeed takes the expert layout
    in each layer's constructor, not in ds_config.json (as service/train/moe.py builds them)."""
    if model is None or model.moe is None:
        return ""
    moe = model.moe
    router = (
        f"drop_tokens=True, capacity_factor={moe.capacity_factor:g}"
        if moe.router == "capacity"
        else "drop_tokens=False (dropless)"
    )
    return (
        f"# its MoE blocks are deepspeed.moe.layer.MoE(num_experts={moe.num_experts}, ep_size={plan.ep}, "
        f"k={moe.experts_per_token},\n#   {router}, "
        f"enable_expert_tensor_parallelism={plan.expert_tp > 1}): ds_config.json has no expert layout.\n"
    )
