"""The steps of `Run.fit()` after the proxies ran, each a function from typed records to a typed record:

    rank_prior(spec, prior)                   -> Scored         every plan on the starting parameters
    Run._run_proxies(ranked)                  -> ProxyEvidence  what the proxies measured
    calibrate(spec, proxies, prior)           -> Fitted         parameters refit on them, and how well
    decide(spec, proxies, fitted, prior)      -> Decision       every cluster ranked, the choice, memo rows
    assemble(spec, proxies, fitted, decision) -> RunResult      what the memo, result.json and MLflow read

`service/design/finish.py` then writes the outputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.design import calibration as cal
from service.design.decide import Scored, best_cluster, other_engines, score
from service.design.evidence import evidence, tie_group
from service.design.experts import expert_parallelism
from service.design.goodput import goodput_record
from service.design.rows import memo_rows
from service.design.sensitivity import sensitivity
from service.design.validate import Choice
from service.plans.select import MEETS_BUDGET
from service.report.decision_records import Alternative, Goodput, OtherEngines, Sensitivity
from service.report.proxy_records import Calibration, ProxyDesign, ProxyValidation
from service.report.result import (
    CALIBRATED,
    PRIOR,
    PUBLISHED,
    ClusterSummary,
    Extrapolation,
    Headline,
    PlanRow,
    ProxyTrial,
    RunResult,
)
from service.search.result import SearchResult, TrialRecord
from service.spec.experiment import ExperimentSpec
from service.spec.params import ModelParams
from service.spec.production import checkpoint_bytes
from service.spec.record import Metrics
from service.spec.units import GIB


@dataclass(frozen=True)
class ProxyEvidence:
    """What the proxies gave: the experiment they ran as, their design, the production plans they stand
    for, and the search that ran them (None when none ran)."""

    experiment: ExperimentSpec
    design: ProxyDesign
    choices: list[Choice]
    search: SearchResult | None
    search_name: str | None
    on_gpu: bool  # they ran on the production GPU type: their time terms are fitted too

    @property
    def trials(self) -> list[TrialRecord]:
        return list(self.search.trials) if self.search else []


@dataclass(frozen=True)
class Fitted:
    """The parameters refit on the proxies, and how well the refit model predicts them."""

    params: ModelParams
    calibration: Calibration
    proxies: list[ProxyTrial]
    validation: ProxyValidation
    extrapolation: Extrapolation
    memory_errors: tuple[float, float]


@dataclass(frozen=True)
class Decision:
    """Every cluster of the experiment ranked on the refit parameters, the one that wins, the plan chosen
    after the sensitivity scenarios (`chosen`, a row of `main`), and the memo's plan rows."""

    scored: list[Scored]
    win: int | None
    sensitivity: Sensitivity
    chosen: int | None
    rows: list[PlanRow]
    other_engines: OtherEngines | None = None  # the listed engines `run` does not launch

    @property
    def main(self) -> Scored:
        return self.scored[self.win if self.win is not None else 0]

    @property
    def selected(self) -> PlanRow | None:
        return self.rows[0] if self.rows and self.rows[0].status == "selected" else None


def rank_prior(spec: ExperimentSpec, prior: ModelParams) -> Scored:
    """Every plan of the experiment's cluster under the parameters `run` starts from."""
    return score(
        spec.model,
        spec.cluster,
        spec.workload,
        spec.budget,
        prior,
        spec.goodput,
        quantized_collectives=spec.quantized_collectives,
    )


def calibrate(spec: ExperimentSpec, proxies: ProxyEvidence, prior: ModelParams) -> Fitted:
    """Refits the memory terms (and the time terms, on the production GPU type) on the proxies' trials,
    scores the refit leave-one-out, and widens the intervals for the distance to production scale."""
    exp, trials = proxies.experiment, proxies.trials
    source = f"proxies:{proxies.search_name or 'none'}"
    params, calibration = cal.calibrate(exp, trials, prior, proxies.on_gpu, source)
    calibrated = calibration.calibrated
    loo = cal.leave_one_out(exp, trials, prior, source) if calibrated else {}
    records = proxy_records(exp, trials, proxies.choices, prior, params if calibrated else None)
    validation = cal.validation_error(
        records, loo, calibrated, time_fitted=proxies.on_gpu, on_cpu=proxies.design.device == "cpu"
    )
    extrap = cal.extrapolation(spec, exp, proxies.design, measured=validation.n > 0)
    return Fitted(params, calibration, records, validation, extrap, cal.memory_errors(validation, calibrated))


def proxy_records(
    exp: ExperimentSpec,
    trials: list[TrialRecord],
    choices: list[Choice],
    prior: ModelParams,
    params: ModelParams | None,
) -> list[ProxyTrial]:
    """Each proxy trial with the production plan it stands for and the prior's and refit's predictions."""
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
                predicted_prior=cal.proxy_prediction(exp, t.plan, prior, t.measured.moe_load),
                predicted_calibrated=cal.proxy_prediction(exp, t.plan, params, t.measured.moe_load)
                if params
                else Metrics(),
                mlflow_run_id=t.mlflow_run_id,
            )
        )
    return out


def decide(spec: ExperimentSpec, proxies: ProxyEvidence, fitted: Fitted, prior: ModelParams) -> Decision:
    """Ranks every cluster on the refit parameters, picks the winning cluster, tests its choice under
    the sensitivity scenarios and builds the memo's plan rows."""
    clusters = [spec.cluster, *(a.cluster for a in spec.alternatives)]
    scored = [
        score(
            spec.model,
            c,
            spec.workload,
            spec.budget,
            fitted.params,
            spec.goodput,
            quantized_collectives=spec.quantized_collectives,
        )
        for c in clusters
    ]
    win = best_cluster(scored, spec.budget.objective)
    main = scored[win if win is not None else 0]
    sens, chosen = sensitivity(main, spec.model, spec.workload, spec.budget, fitted.params, spec.goodput)
    calibrated = fitted.calibration.calibrated
    rows = memo_rows(
        main,
        chosen,
        main.selection.selected,
        spec.budget,
        fitted.memory_errors,
        fitted.extrapolation.widening,
        calibrated,
        {c.plan.short() for c in proxies.choices},
        time_tag=time_provenance(proxies.on_gpu and calibrated, prior),  # no fit, no "calibrated"
    )
    decision = Decision(scored, win, sens, chosen, rows)
    chosen_tokens = decision.selected.tokens_per_s.value if decision.selected else None
    others = other_engines(spec, fitted.params, main.cluster, chosen_tokens)
    return dataclasses.replace(decision, other_engines=others)


def assemble(
    spec: ExperimentSpec,
    proxies: ProxyEvidence,
    fitted: Fitted,
    decision: Decision,
    out_dir: Path,
    created: str,
) -> RunResult:
    """The run's record: what the memo, result.json and the MLflow parent run are written from."""
    main, selected = decision.main, decision.selected
    return RunResult(
        experiment=spec.name,
        objective=spec.budget.objective,
        budget=spec.budget,
        cluster=_cluster_info(main),
        created=created,
        selected_plan=selected.plan if selected else None,
        selected_label=selected.label if selected else None,
        predicted=_predicted(selected),
        message=_message(main, selected, decision.sensitivity.note),
        binding_constraint=main.selection.binding,
        other_engines=decision.other_engines,
        plans_ranked=len(main.est),
        rows=decision.rows,
        scatter=_scatter(main),
        proxy_design=proxies.design,
        proxies=fitted.proxies,
        calibration=fitted.calibration,
        proxy_validation_error=fitted.validation,
        extrapolation=fitted.extrapolation,
        goodput=_goodput(spec, main, selected),
        sensitivity=decision.sensitivity,
        ties=tie_group(main),
        evidence=evidence(main, decision.chosen, fitted.params, spec.model, spec.workload),
        experts=expert_parallelism(
            main, decision.chosen, spec.model, spec.workload, spec.budget, fitted.params, spec.goodput
        ),
        alternatives=_alternatives(spec, decision.scored, decision.win, decision.chosen),
        out_dir=str(out_dir),
        search_path=str(out_dir / "search" / proxies.search_name) if proxies.search_name else None,
    )


def time_provenance(on_gpu: bool, prior: ModelParams) -> str:
    """Where the time numbers come from: the proxies when they ran on the production GPU type (the time
    terms were refit on them), else the parameter set `run` started from: a fit on published runs
    (the shipped set) or, fit on nothing, the analytical prior."""
    if on_gpu:
        return CALIBRATED
    return PUBLISHED if prior.fit_on else PRIOR


def _goodput(spec: ExperimentSpec, main: Scored, selected: PlanRow | None) -> Goodput | None:
    if selected is None:
        return None
    ckpt = checkpoint_bytes(spec.model, selected.plan.precision)
    return goodput_record(selected.hours_no_failures, main.cluster.num_gpus, ckpt, spec.goodput)


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


def _message(main: Scored, selected: PlanRow | None, robust_note: str) -> str:
    if selected is None:
        return main.selection.message
    return (
        f"selected {selected.label} on {main.cluster.num_gpus} × {main.cluster.gpu.name}: "
        f"{selected.tokens_per_s.value:,.0f} tokens/s, {selected.hours.value:,.1f} h and "
        f"${selected.dollars.value:,.0f} with interruptions included, "
        f"{selected.memory_per_gpu_bytes.value / GIB:.1f} GiB per GPU; sensitivity: {robust_note}"
    )


def _alternatives(
    spec: ExperimentSpec, scored: list[Scored], win: int | None, chosen: int | None
) -> list[Alternative]:
    """Each cluster's plan against the one chosen: on the winning cluster the plan chosen after the
    sensitivity scenarios (`chosen`), elsewhere each cluster's own selection."""
    out = []
    for i, s in enumerate(scored):
        row = chosen if i == win else s.selection.selected
        availability = spec.alternatives[i - 1].availability if i > 0 else "the experiment's cluster"
        if row is None:
            outcome = f"no plan meets the budget: {s.selection.binding}"
        elif i == win:
            outcome = "selected"
        else:
            w = scored[win] if win is not None else None
            wr = chosen if w is not None else None
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
