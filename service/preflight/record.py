"""The preflight as a measured run: a runs file (service/calibrate/runs.py's YAML format) that
`python -m service calibrate` reads and `plan --params` can re-plan with.

One source (the cluster and the stack, named after the experiment and the GPU type), the experiment's
model inline (so the file stands alone), and one measurement row: the plan as `Plan` fields and the
measured tokens/s per GPU. A CPU worker computes in `proxy.precision` whatever the plan says; the runs
format knows only bf16/fp16/fp8, so such a row keeps the plan's precision (what the planner priced)
and says what ran in `assumptions`, marked `approximate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from service.spec.experiment import ExperimentSpec
from service.spec.plan import Plan

RUNS_FILE = "preflight_run.yaml"
ROW_PRECISIONS = ("bf16", "fp16", "fp8")


def source_name(experiment: ExperimentSpec) -> str:
    return f"preflight-{experiment.name}-{experiment.cluster.gpu.name}"


def _gpu_overrides(experiment: ExperimentSpec) -> dict[str, float]:
    """The numeric fields where the experiment's GPU differs from the catalog entry of its name."""
    from service.catalog import load_gpu

    gpu = experiment.cluster.gpu
    base = load_gpu(gpu.name).model_dump()
    return {
        k: float(v)
        for k, v in gpu.model_dump().items()
        if isinstance(v, int | float) and not isinstance(v, bool) and v != base.get(k)
    }


def runs_document(
    experiment: ExperimentSpec,
    plan: Plan,
    ran_precision: str,
    tokens_per_s: float,
    *,
    run_id: str,
    when: str,
    notes: str = "",
) -> dict[str, Any]:
    """The runs file's content for one preflight: `tokens_per_s` is the whole run's."""
    cluster, workload = experiment.cluster, experiment.workload
    assumptions: list[str] = []
    precision = plan.precision
    if precision not in ROW_PRECISIONS or ran_precision != plan.precision:
        assumptions.append(
            f"the workers computed in {ran_precision} (the plan says {plan.precision}; the row keeps "
            f"{precision if precision in ROW_PRECISIONS else 'bf16'}, what the planner priced)"
        )
        precision = precision if precision in ROW_PRECISIONS else "bf16"
    source = source_name(experiment)
    row: dict[str, Any] = {
        "id": run_id,
        "source": source,
        "ref": f"{RUNS_FILE}, written by `python -m service preflight` on {when}",
        "model": experiment.model.name,
        "gpu": cluster.gpu.name,
        "num_gpus": plan.num_gpus,
        "gpus_per_node": cluster.gpus_per_node,
        **{k: getattr(plan, k) for k in ("dp", "tp", "pp", "cp", "zero_stage", "micro_batch", "grad_accum")},
        "global_batch": plan.sequences_per_step,
        "seq_len": workload.seq_len,
        "recompute": plan.recompute,
        "sequence_parallel": plan.sequence_parallel,
        "virtual_stages": plan.virtual_stages,
        "comm_overlap": plan.comm_overlap,
        "tp_comm_overlap": plan.tp_comm_overlap,
        "shard_group_size": plan.shard_group_size,
        **{k: getattr(plan, k) for k in ("offload_optimizer", "offload_params", "zero_hpz_partition_size")},
        **{k: getattr(plan, k) for k in ("zero_quantized_weights", "zero_quantized_gradients")},
        "engine": plan.engine,
        "zero3_collectives": workload.zero3_collectives,
        "selective_recompute": workload.selective_recompute,
        "precision": precision,
        "measured": {"tokens_per_s_per_gpu": float(tokens_per_s) / plan.num_gpus},
        "approximate": bool(assumptions),
        "assumptions": assumptions,
        "notes": notes,
    }
    overrides = _gpu_overrides(experiment)
    if overrides:
        row["gpu_overrides"] = overrides
    model = experiment.model.model_dump(mode="json", exclude={"name"})
    return {
        "sources": {
            source: {
                "citation": f"`python -m service preflight` of experiment {experiment.name} on its cluster "
                f"({cluster.num_nodes} × {cluster.gpus_per_node} {cluster.gpu.name}), {when}",
                "framework": f"DeepSpeed under Ray Train ({plan.engine} plan {plan.short()})",
                "metric": "tokens/s of the production worker's warm steps (step log, rank 0), per GPU",
                "engine": plan.engine,
                "flash_attention": workload.flash_attention,
                "cudnn_attention": workload.cudnn_attention,
                "fused_elementwise": workload.fused_elementwise,
            }
        },
        "models": {experiment.model.name: model},
        "measurements": [row],
    }


def write_runs_file(document: dict[str, Any], out_dir: str | Path) -> Path:
    """Writes `document` as `<out_dir>/preflight_run.yaml` and checks it reads back as a runs file."""
    from service.calibrate.runs import load_runs

    path = Path(out_dir) / RUNS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# A measured run written by `python -m service preflight`: calibrate on it with\n"
        f"#   python -m service calibrate {path}\n"
        + yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    )
    load_runs(path)  # the format calibrate reads; a SpecError here is a bug in this module
    return path
