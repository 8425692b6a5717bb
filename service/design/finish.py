"""The last step of `Run.fit()`: risks and assumptions, the production DeepSpeed config and launch
command, the memo, `result.json`, and the MLflow parent run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from service.cluster import storage
from service.design.decide import LAUNCHED_ENGINES, Scored
from service.design.outputs import (
    dump_json,
    launch_command,
    log_outputs,
    offers_service_train,
    open_parent_run,
    production_ds_config,
    ray_job_command,
    write_launch_script,
)
from service.plans.select import GIB
from service.report.proxy_records import Calibration
from service.report.result import Assumption, RunResult
from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec
from service.spec.params import ParamsSummary
from service.spec.plan import Plan

RESULT_FILE = "result.json"


def risks(result: RunResult) -> list[str]:
    """What could make the decision wrong, most important first."""
    out: list[str] = []
    sel = result.selected
    if sel is None:
        return [
            f"no plan meets the budget ({result.binding_constraint}); the memo's fallback is not a decision"
        ]
    mem = sel.memory_per_gpu_bytes
    if mem.high > sel.memory_limit_bytes:
        over = "the GPU's memory" if mem.high > sel.hbm_bytes else "the headroom limit"
        out.append(
            f"memory: the interval's high end, {mem.high / GIB:.1f} GiB per GPU, exceeds {over} "
            f"({sel.memory_limit_bytes / GIB:.1f} GiB limit, {sel.hbm_bytes / GIB:.1f} GiB HBM): run the "
            "first two steps with memory logging before committing the budget (Adam's states are allocated "
            "at the first optimizer step); " + _plan_b(result)
        )
    cal = result.calibration
    if not cal.calibrated:
        out.append(f"memory is not calibrated ({cal.status}): memory numbers are the analytical prior")
    if "published-set" in cal.time_terms or not cal.calibrated:
        out.append(
            "throughput, hours and dollars rest on the published-set time parameters, not on measurements "
            "of this model on this cluster: time a few production steps first"
        )
    if sel.tokens_per_s.low == sel.tokens_per_s.high:
        out.append("the parameter set carries no out-of-sample residuals: throughput has no interval")
    failed = [p for p in result.proxies if p.status != "ok"]
    if failed:
        out.append(
            "proxies that did not finish: "
            + "; ".join(f"{p.proxy_label}: {p.status} {p.reason[:120]}" for p in failed)
        )
    ext = result.extrapolation
    if ext is not None and ext.widening >= 3:
        out.append(
            f"long extrapolation: {sum(ext.doublings.values()):.1f} doublings from proxy to production "
            f"(memory intervals widened {ext.widening:.1f}×)"
        )
    sens = result.sensitivity
    if sens is not None and sens.flips:
        out.append(
            "the choice leaves the best plan's tie group under: " + ", ".join(sens.flips) + f" ({sens.note})"
        )
    if result.goodput is not None and result.goodput.expected_interruptions >= 0.5:
        out.append(
            f"{result.goodput.expected_interruptions:.1f} interruptions expected: checkpoint every "
            f"{result.goodput.checkpoint_interval_hours:.1f} h"
        )
    at_bounds = cal.at_bounds
    if at_bounds:
        out.append(
            "fitted parameters at the edge of their band (the data push further): "
            + ", ".join(f"{k} ({v})" for k, v in at_bounds.items())
        )
    return out


CLUSTER_FILE = "ray_cluster.yaml"  # the shipped cluster file, at the repository's top


def cluster_network(spec: ExperimentSpec, cluster_file: Path | None = None) -> tuple[Assumption, str | None]:
    """The inter-node bandwidth the plan is priced at beside what the cluster file delivers per node
    (service.cluster.network: counted from its EFA interfaces); a risk when the file delivers less.
    One node, or no cluster file: the assumption row alone."""
    from service.cluster.network import declared_network
    from service.tracking.uri import repo_root

    priced_gbps = spec.cluster.gpu.inter_node_bandwidth_gb_per_s * 8 * spec.cluster.gpus_per_node
    row = Assumption(
        what=f"inter-node network {priced_gbps:,.0f} Gb/s per node", source="GPU catalog, experiment"
    )
    path = cluster_file or repo_root() / CLUSTER_FILE
    if spec.cluster.num_nodes <= 1 or not path.is_file():
        return row, None
    try:
        gbps, _, why = declared_network(path)
    except SpecError as err:
        return row.model_copy(update={"source": f"{row.source}; {path.name} unreadable: {err}"}), None
    delivers = f"{row.source}; {path.name} delivers {gbps:,.0f} Gb/s per node: {why}"
    row = row.model_copy(update={"source": delivers})
    if gbps >= priced_gbps:
        return row, None
    return row, (
        f"network: {path.name} delivers {gbps:,.0f} Gb/s per node, below the {priced_gbps:,.0f} Gb/s the "
        f"plan is priced at; give its GPU nodes their EFA interfaces, or re-plan with "
        f"cluster.inter_node_bandwidth_gb_per_s: {gbps / 8 / spec.cluster.gpus_per_node:g}"
    )


def _plan_b(result: RunResult) -> str:
    fallback = result.memory_fallback
    if fallback is None:
        return "no plan that meets the budget stays under the limit at its interval's high end"
    mem = fallback.memory_per_gpu_bytes
    return (
        f"if it runs out of memory, run {fallback.label} ({mem.value / GIB:.1f} GiB, 80 %: "
        f"{mem.low / GIB:.1f}–{mem.high / GIB:.1f}; {fallback.hours.value:.2f} h, "
        f"${fallback.dollars.value:,.0f}{'; its proxy ran' if fallback.validated else ''})"
    )


def assumptions(result: RunResult, spec: ExperimentSpec) -> list[Assumption]:
    gp, n = spec.goodput, spec.cluster.num_gpus
    rows = [
        {
            "what": "memory and time formulas",
            "source": "service/costmodel: ZeRO (Rajbhandari et al. 2020), "
            "Megatron-LM (Narayanan et al. 2021), Korthikanti et al. 2022, FlashAttention (Dao 2022), "
            "PaLM MFU",
        },
        {
            "what": f"GPU figures ({spec.cluster.gpu.name})",
            "source": spec.cluster.gpu.source or "GPU catalog",
        },
        {"what": "time terms (parameter set)", "source": _summary(result.calibration.prior or None)},
        {"what": "memory terms", "source": _memory_source(result.calibration)},
        {
            "what": "price per GPU-hour",
            "source": f"${spec.cluster.price_usd_per_gpu_hour:g} (the experiment)",
        },
        {
            "what": f"interruption rate {gp.rate_per_gpu_hour(n):.3g} per GPU-hour",
            "source": gp.source_for(n),
        },
        {"what": "checkpoint storage bandwidth", "source": gp.storage_source},
        {
            "what": f"restart time {gp.restart_minutes:g} min",
            "source": "assumption (set goodput.restart_minutes)",
        },
        {
            "what": "checkpoint size 14 bytes/param (bf16 weights + fp32 master + 2 Adam moments)",
            "source": "ZeRO (Rajbhandari et al. 2020, §3.1: K = 12 optimizer bytes per parameter)",
        },
        {"what": "checkpoint interval", "source": "Young 1974 / Daly 2006: sqrt(2 · write time · MTBF)"},
        {"what": "proxies", "source": result.proxy_design.why},
        *_engines_row(spec),
    ]
    return [Assumption(**row) for row in rows]


def _engines_row(spec: ExperimentSpec) -> list[dict[str, str]]:
    """Which engines the memo ranked, where the experiment lists others too."""
    others = [e for e in spec.engines if e not in LAUNCHED_ENGINES]
    if not others:
        return []
    return [
        {
            "what": f"plans of {', '.join(LAUNCHED_ENGINES)} only",
            "source": "the engines run proves on proxies and launches; `python -m service plan` ranks "
            + ", ".join(others)
            + " too",
        }
    ]


def _memory_source(cal: Calibration) -> str:
    if not cal.calibrated:
        return f"analytical prior ({cal.status})"
    after = cal.after.get("activation_memory_scale")
    return (
        f"activation_memory_scale = {after:.4f} fitted on {cal.runs} proxies ({cal.source}); "
        "memory interval: the rule under Extrapolation distance"
    )


def _summary(s: ParamsSummary | None) -> str:
    if s is None:
        return "analytical prior"
    fit_on = ", ".join(s.fit_on) or "nothing (analytical prior)"
    return f"{s.name} v{s.version}, fit on {fit_on} ({s.fit_runs} runs); {s.interval}"


def finish(
    result: RunResult,
    spec: ExperimentSpec,
    main: Scored,
    chosen: int | None,
    search_name: str | None,
    started: float,
    experiment_path: str | None = None,
) -> RunResult:
    from service.report import write_memo

    folder = Path(result.out_dir)
    updates: dict[str, Any] = {}
    if chosen is not None:
        plan: Plan = main.plans.row(chosen)
        ds = production_ds_config(plan, spec.model_copy(update={"cluster": main.cluster}))
        ds_path = dump_json(folder / "ds_config.json", ds)
        deepspeed = launch_command(plan, main.cluster, ds_path)
        train_job = offers_service_train(spec, main.cluster, experiment_path, plan)
        command = ray_job_command(experiment_path, plan) if train_job else deepspeed  # type: ignore[arg-type]
        write_launch_script(
            folder / "launch.sh", command, plan, main.cluster, deepspeed, spec.model, train_job=train_job
        )
        updates.update(
            ds_config=ds, ds_config_path=str(ds_path), launch_command=command, deepspeed_command=deepspeed
        )
    else:
        # No plan to launch: a config and script an earlier run left in this folder would contradict
        # the memo written beside them.
        for stale in ("ds_config.json", "launch.sh"):
            (folder / stale).unlink(missing_ok=True)
    result = result.model_copy(update=updates)
    network, network_risk = cluster_network(spec)
    result = result.model_copy(
        update={
            "risks": risks(result) + ([network_risk] if network_risk else []),
            "assumptions": [*assumptions(result, spec), network],
        }
    )
    key = f"search:{search_name}" if search_name else f"run:{spec.name}:{int(started)}"
    tracker, run_id, uri = open_parent_run(spec, key, search_name or f"run-{spec.name}")
    result = result.model_copy(update={"mlflow_run_id": run_id, "tracking_uri": uri})
    memo = write_memo(result, folder)
    paths = {k: str(v) for k, v in memo.items() if k in ("markdown", "html")}
    # A remote $SERVICE_STORAGE_PATH (s3://...) gets a copy of the finished folder: the result says where.
    remote = storage.remote_root()
    copied_to = f"{remote}/run/{folder.name}" if remote else None
    result = result.model_copy(
        update={"memo_paths": paths, "wall_s": time.time() - started, "copied_to": copied_to}
    )
    result.save(folder / RESULT_FILE)
    files = [folder / "ds_config.json", folder / "launch.sh", *memo.values(), folder / RESULT_FILE]
    log_outputs(tracker, key, result, files)
    if remote:
        storage.publish(folder, "run", folder.name, remote)
    return result
