"""`Run`: small runs → a defended production plan → a memo. Shaped like Ray's API: config in, `fit()`,
a typed `RunResult` out.

    >>> from service import Run
    >>> result = Run("experiments/llama2-13b-32xh100.yaml").fit()               # doctest: +SKIP
    >>> result.selected_label, result.predicted["hours"], result.memo_paths     # doctest: +SKIP

Pipeline: 1 rank every plan with intervals (the published-set parameters); 2 choose what to validate
(service/design/validate.py); 3 shape the proxies; 4 run them through the Ray Tune `Search` and calibrate
the memory terms on them (time terms too when they ran on the production GPU type); 5 extrapolate
with widening intervals; 6 select under the budget on the calibrated model with goodput included,
across GPU types, and test the choice under ±20 %; 7 goodput; 8 write the DeepSpeed config, the launch
command, the memo, and the MLflow parent run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from service.design import calibration as cal
from service.design.decide import Scored, best_cluster, score
from service.design.evidence import evidence, tie_group
from service.design.experts import expert_parallelism
from service.design.goodput import goodput_record
from service.design.proxies import run_proxies
from service.design.rows import memo_rows
from service.design.sensitivity import sensitivity
from service.design.validate import choose, design_proxy
from service.plans.select import MEETS_BUDGET
from service.report.decision_records import Alternative
from service.report.proxy_records import ProxyChoice, ProxyDesign
from service.report.result import (
    CALIBRATED,
    PRIOR,
    PUBLISHED,
    ClusterSummary,
    Headline,
    PlanRow,
    ProxyTrial,
    RunResult,
)
from service.search.result import SearchResult
from service.spec.errors import SpecError
from service.spec.experiment import ExperimentSpec, load_experiment
from service.spec.params import ModelParams, load_params
from service.spec.production import checkpoint_bytes
from service.spec.record import Metrics
from service.spec.units import GIB
from service.tracking.uri import repo_root

DEFAULT_MAX_PROXIES = 4


def default_out_dir(experiment: ExperimentSpec) -> Path:
    """`run/<name>` under the results folder ($SERVICE_STORAGE_PATH on a cluster, else the repository's
    ray_results; see service.cluster.storage); a name that would leave that folder is refused (the spec
    refuses such names already; `model_construct` skips the spec's check)."""
    from service.cluster.storage import results_root

    root = (results_root(repo_root() / "ray_results") / "run").resolve()
    out = (root / experiment.name).resolve()
    if out.parent != root:
        raise SpecError("name", f"{experiment.name!r} is not a plain folder name; it would leave {root}")
    return out


def detect_device() -> tuple[str, str, int]:
    """("cuda", device name, GPUs) when a CUDA GPU is here, else ("cpu", "", 0)."""
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda", str(torch.cuda.get_device_name(0)), int(torch.cuda.device_count())
    except ImportError:
        pass
    return "cpu", "", 0


def same_device(proxy_device: str, catalog_name: str, device_name: str) -> bool:
    """Whether the proxies run on the production device type: CPU proxies for a `cpu` cluster, or a
    CUDA device (e.g. 'NVIDIA H100 80GB HBM3') of the catalog's type ('h100-sxm-80gb')."""
    if proxy_device == "cpu":
        return catalog_name == "cpu"
    return bool(device_name) and catalog_name.split("-")[0].upper() in device_name.upper()


def time_terms_for(design: ProxyDesign, same: bool) -> ProxyDesign:
    """The design with what the memo says about time terms, once it is known whether the proxies ran on
    the production device type (only then are time terms fitted on them)."""
    if not same:
        why = "kept at the published-set parameters (the proxies ran on another device type)"
        return design.model_copy(update={"time_terms": why})
    return design.model_copy(
        update={
            "time_terms": "fitted on the proxies: they ran on the production device type",
            "identifies": [
                *design.identifies,
                "time terms (efficiencies, per-step overheads) on this device type",
            ],
            "cannot_identify": [c for c in design.cannot_identify if not c.startswith("GPU time terms")],
        }
    )


class Run:
    """Plans, validates on proxies, calibrates, selects and writes the memo for one experiment.

    Args:
        experiment: an `ExperimentSpec` or the path of its YAML.
        params: the cost model's parameter set (a `ModelParams` or a YAML path); None = the shipped one.
        storage_path: the run's folder (memo, configs, the proxy search); a folder holding a killed
            run's search continues it. Default: `run/<experiment>` under $SERVICE_STORAGE_PATH, else under
            `<repo>/ray_results`.
        max_proxies: most proxy plans to run (each a Ray Train trial).
        proxy_steps: optimizer steps per proxy (default: the proxy spec's).
        device: "cpu" or "cuda" for the proxies (default: cuda when a GPU is here).
        run_proxies: False plans and writes the memo on the prior alone (no Ray).
        progress: a progress bar on stderr while proxies run.
    """

    def __init__(
        self,
        experiment: ExperimentSpec | str | Path,
        *,
        params: ModelParams | str | Path | None = None,
        storage_path: str | Path | None = None,
        max_proxies: int = DEFAULT_MAX_PROXIES,
        proxy_steps: int | None = None,
        device: str | None = None,
        run_proxies: bool = True,
        progress: bool = False,
    ):
        self.spec = experiment if isinstance(experiment, ExperimentSpec) else load_experiment(experiment)
        self.experiment_path = None if isinstance(experiment, ExperimentSpec) else str(experiment)
        self.params = params if isinstance(params, ModelParams) else load_params(params)
        if max_proxies < 0:
            raise SpecError("max_proxies", f"must be 0 or more, got {max_proxies}")
        self.out_dir = Path(storage_path or default_out_dir(self.spec)).resolve()
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise SpecError("storage_path", f"{self.out_dir} is a file, not a folder")
        self.max_proxies = max_proxies if run_proxies else 0
        self.proxy_steps = proxy_steps
        if device not in (None, "cpu", "cuda"):
            raise SpecError("device", f"unknown device {device!r}; allowed: cpu, cuda")
        self.device, self.device_name, self.devices = detect_device()
        if device is not None and device != self.device:
            self.device, self.device_name, self.devices = device, "", 0
        self.progress = progress

    # -- the pipeline ------------------------------------------------------------------------------
    def fit(self) -> RunResult:
        """Runs the pipeline. One run per output folder at a time: while another process runs in
        `out_dir`, this raises `FolderLocked` (a `SpecError`) naming the folder and that process."""
        from service.search.lock import folder_lock

        with folder_lock(self.out_dir, "run"):  # creates the folder
            return self._fit()

    def _fit(self) -> RunResult:
        started = time.time()
        spec, prior = self.spec, self.params
        quantized = spec.quantized_collectives
        prior_scored = score(
            spec.model,
            spec.cluster,
            spec.workload,
            spec.budget,
            prior,
            spec.goodput,
            quantized_collectives=quantized,
        )
        proxy_exp, design = design_proxy(spec, self.device, self.devices or None)
        on_gpu = same_device(design.device, spec.cluster.gpu.name, self.device_name)
        order = [(int(r), prior_scored.plans.row(int(r))) for r in prior_scored.selection.order]
        choices, notes = choose(order, proxy_exp, self.max_proxies)
        picked = [ProxyChoice(plan=c.plan.short(), proxy=c.proxy_plan.short(), why=c.reason) for c in choices]
        design = time_terms_for(design, on_gpu).model_copy(update={"choices": picked, "skipped": notes})
        search, search_name = self._proxies(proxy_exp, choices)
        trials = search.trials if search else []
        source = f"proxies:{search_name or 'none'}"
        params, calibration = cal.calibrate(proxy_exp, trials, prior, on_gpu, source)
        calibrated = calibration.calibrated
        loo = cal.leave_one_out(proxy_exp, trials, prior, source) if calibrated else {}
        proxies = self._proxy_records(proxy_exp, trials, choices, prior, params if calibrated else None)
        validation = cal.validation_error(
            proxies, loo, calibrated, time_fitted=on_gpu, on_cpu=design.device == "cpu"
        )
        extrap = cal.extrapolation(spec, proxy_exp, design, measured=validation.n > 0)
        errors = cal.memory_errors(validation, calibrated)
        clusters = [spec.cluster, *(a.cluster for a in spec.alternatives)]
        scored = [
            score(
                spec.model,
                c,
                spec.workload,
                spec.budget,
                params,
                spec.goodput,
                quantized_collectives=quantized,
            )
            for c in clusters
        ]
        win = best_cluster(scored, spec.budget.objective)
        main = scored[win if win is not None else 0]
        sens, chosen = sensitivity(main, spec.model, spec.workload, spec.budget, params, spec.goodput)
        rows = memo_rows(
            main,
            chosen,
            main.selection.selected,
            spec.budget,
            errors,
            extrap.widening,
            calibrated,
            {c.plan.short() for c in choices},
            time_tag=time_provenance(on_gpu and calibrated, prior),  # no fit, no "calibrated"
        )
        selected = rows[0] if rows and rows[0].status == "selected" else None
        result = RunResult(
            experiment=spec.name,
            objective=spec.budget.objective,
            budget=spec.budget,
            cluster=_cluster_info(main),
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            selected_plan=selected.plan if selected else None,
            selected_label=selected.label if selected else None,
            predicted=_predicted(selected),
            message=_message(main, selected, sens.note),
            binding_constraint=main.selection.binding,
            plans_ranked=len(main.est),
            rows=rows,
            scatter=_scatter(main),
            proxy_design=design,
            proxies=proxies,
            calibration=calibration,
            proxy_validation_error=validation,
            extrapolation=extrap,
            goodput=self._goodput(main, selected),
            sensitivity=sens,
            ties=tie_group(main),
            evidence=evidence(main, chosen, params, spec.model, spec.workload),
            experts=expert_parallelism(
                main, chosen, spec.model, spec.workload, spec.budget, params, spec.goodput
            ),
            alternatives=_alternatives(spec, scored, win),
            out_dir=str(self.out_dir),
            search_path=str(self.out_dir / "search" / search_name) if search_name else None,
        )
        from service.design.finish import finish

        return finish(result, spec, main, chosen, search_name, started, self.experiment_path)

    def _proxies(
        self, proxy_exp: ExperimentSpec, choices: list[Any]
    ) -> tuple[SearchResult | None, str | None]:
        if not choices:
            return None, None
        result, name = run_proxies(
            proxy_exp, choices, self.out_dir / "search", self.proxy_steps, self.progress
        )
        return result, name

    def _proxy_records(
        self,
        proxy_exp: ExperimentSpec,
        trials: Sequence[Any],
        choices: list[Any],
        prior: ModelParams,
        params: ModelParams | None,
    ) -> list[ProxyTrial]:
        by_proxy = {c.proxy_plan.short(): c for c in choices}
        out = []
        for t in trials:
            choice = by_proxy.get(t.key)
            out.append(
                ProxyTrial(
                    trial_id=t.trial_id,
                    production_label=choice.plan.short() if choice else "",
                    proxy_label=t.key,
                    proxy_plan=t.plan,
                    status=t.status,
                    reason=t.reason,
                    measured=t.measured,
                    predicted_prior=cal.proxy_prediction(proxy_exp, t.plan, prior, t.measured.moe_load),
                    predicted_calibrated=cal.proxy_prediction(proxy_exp, t.plan, params, t.measured.moe_load)
                    if params
                    else Metrics(),
                    mlflow_run_id=t.mlflow_run_id,
                )
            )
        return out

    def _goodput(self, main: Scored, selected: Any) -> Any:
        if selected is None:
            return None
        plan = selected.plan
        ckpt = checkpoint_bytes(self.spec.model, plan.precision)
        return goodput_record(selected.hours_no_failures, main.cluster.num_gpus, ckpt, self.spec.goodput)


def _scatter(s: Scored) -> list[list[float]]:
    fits = np.flatnonzero(s.est.fits.astype(bool))
    meets = np.isin(s.selection.status[fits], MEETS_BUDGET)
    return [
        [float(s.est.tokens_per_s[r]), float(s.est.dollars[r]), float(m)]
        for r, m in zip(fits, meets, strict=True)
    ]


def _cluster_info(s: Scored) -> ClusterSummary:
    c = s.cluster
    return ClusterSummary(
        gpu=c.gpu.name,
        num_nodes=c.num_nodes,
        gpus_per_node=c.gpus_per_node,
        num_gpus=c.num_gpus,
        price_per_gpu_hour_usd=c.price_usd_per_gpu_hour,
        hbm_gib=c.gpu.hbm_gib,
        inter_node_bandwidth_gb_per_s=c.gpu.inter_node_bandwidth_gb_per_s,
    )


def _predicted(row: PlanRow | None) -> Headline | None:
    if row is None:
        return None
    return Headline(
        tokens_per_s=row.tokens_per_s.public(),
        hours=row.hours.public(),
        dollars=row.dollars.public(),
        memory_per_gpu_bytes=row.memory_per_gpu_bytes.public(),
        memory_limit_bytes=row.memory_limit_bytes,
        mfu=row.mfu,
    )


def _message(main: Scored, selected: Any, robust_note: str) -> str:
    if selected is None:
        return main.selection.message
    return (
        f"selected {selected.label} on {main.cluster.num_gpus} × {main.cluster.gpu.name}: "
        f"{selected.tokens_per_s.value:,.0f} tokens/s, {selected.hours.value:,.1f} h and "
        f"${selected.dollars.value:,.0f} with interruptions included, "
        f"{selected.memory_per_gpu_bytes.value / GIB:.1f} GiB per GPU; sensitivity: {robust_note}"
    )


def _alternatives(spec: ExperimentSpec, scored: list[Scored], win: int | None) -> list[Alternative]:
    out = []
    for i, s in enumerate(scored):
        row = s.selection.selected
        availability = spec.alternatives[i - 1].availability if i > 0 else "the experiment's cluster"
        if row is None:
            outcome = f"no plan meets the budget: {s.selection.binding}"
        elif i == win:
            outcome = "selected"
        else:
            w = scored[win] if win is not None else None
            wr = w.selection.selected if w is not None else None
            if w is not None and wr is not None and spec.budget.objective == "cost":
                outcome = f"${s.est.dollars[row]:,.0f} vs ${w.est.dollars[wr]:,.0f} on {w.cluster.gpu.name}"
            elif w is not None and wr is not None:
                outcome = (
                    f"{s.est.tokens_per_s[row]:,.0f} vs {w.est.tokens_per_s[wr]:,.0f} tokens/s "
                    f"on {w.cluster.gpu.name}"
                )
            else:
                outcome = "not selected"
        out.append(
            Alternative(
                gpu=s.cluster.gpu.name,
                num_gpus=s.cluster.num_gpus,
                price_per_gpu_hour_usd=s.cluster.price_usd_per_gpu_hour,
                availability=availability,
                selected_label=s.plans.row(row).short() if row is not None else None,
                tokens_per_s=float(s.est.tokens_per_s[row]) if row is not None else None,
                hours=float(s.est.hours[row]) if row is not None else None,
                dollars=float(s.est.dollars[row]) if row is not None else None,
                outcome=outcome,
            )
        )
    return out


def time_provenance(on_gpu: bool, prior: ModelParams) -> str:
    """Where the time numbers come from: the proxies when they ran on the production GPU type (the time
    terms were refit on them), else the parameter set `run` started from: a fit on published runs
    (the shipped set) or, fit on nothing, the analytical prior."""
    if on_gpu:
        return CALIBRATED
    return PUBLISHED if prior.fit_on else PRIOR
