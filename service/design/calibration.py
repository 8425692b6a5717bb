"""From proxy measurements to a calibrated parameter set, its proxy error, and the production intervals.

The fit itself is `service.calibrate.fit` (not re-implemented here). Memory terms are always fitted
on the proxies (`MEMORY_PARAMS`: `activation_memory_scale`); time terms only when the proxies ran on
the production GPU type. The out-of-sample error is leave-one-proxy-out: fit on the other proxies,
predict the one left out.

Extrapolation rule for memory (stated in the memo): the relative error e measured on the proxies
(out of sample; at least `MIN_ACTIVATION_ERROR` for activations, `MIN_STATE_ERROR` for model state)
is widened by
    w = 1 + 0.25·(doublings of width + of sequence length) + 0.125·(doublings of layers + of GPUs)
          + 0.5 if the proxy device differs from the production GPU type,
since per-token activation terms change weight with width and sequence length, while layers and GPUs
enter the formulas linearly or by exact sharding. Memory interval = total ± w·(e_act·activations +
e_state·model state). Throughput intervals are the cost model's own (`ModelParams.widening`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from service.report.proxy_records import Calibration, ProxyDesign, ProxyError, ProxyValidation
from service.report.result import Extrapolation, Scale
from service.search.result import TrialRecord
from service.spec.experiment import ExperimentSpec
from service.spec.param_bands import MEMORY_PARAMS, TIME_PARAMS
from service.spec.params import ModelParams
from service.spec.plan import Plan
from service.spec.record import Metrics

MIN_ACTIVATION_ERROR = 0.05
MIN_STATE_ERROR = 0.01
PRIOR_ACTIVATION_ERROR = 0.25  # no proxy measured: the memo says the interval is a prior guess
MEMORY_RULE = (
    "memory total ± w·(e_act·(activations + logits) + e_state·model state), e from leave-one-proxy-out "
    f"errors (floors {MIN_ACTIVATION_ERROR:.0%} / {MIN_STATE_ERROR:.0%}), w = 1 + 0.25·(width + sequence "
    "doublings) + 0.125·(layer + GPU doublings) + 0.5 for another device type"
)
NO_PROXY_RULE = (
    f"no proxy measured: memory total ± {PRIOR_ACTIVATION_ERROR:.0%}·(activations + logits + model state), "
    "the analytical model's prior error (a band, not a measured 80 % interval), not widened (there is no "
    "proxy to extrapolate from)"
)


def proxy_prediction(
    exp: ExperimentSpec, plan: Plan, params: ModelParams, moe_load: float | None = None
) -> Metrics:
    """The cost model's numbers for a proxy run (per rank), with `params`; a MoE proxy's experts at
    `moe_load`, the load it measured (`proxy_scale.proxy_workload`), so that its activations are compared
    and fitted like for like. The production estimate keeps the experiment's own imbalance."""
    from service.costmodel import estimate
    from service.train.proxy_scale import per_rank_metrics, proxy_cluster, proxy_model, proxy_workload

    est = estimate(
        proxy_model(exp),
        proxy_cluster(exp, plan.num_gpus),
        plan,
        proxy_workload(exp, plan, moe_load),
        memory_headroom=exp.budget.memory_headroom,
        params=params,
    )
    return per_rank_metrics(est)


def measured_runs(exp: ExperimentSpec, trials: Sequence[TrialRecord], source: str) -> list[Any]:
    """`MeasuredRun`s of the proxies that ran all their steps.

    The proxy's meter counts every tensor autograd saves, the loss's logits included; the cost model
    keeps logits as a term of their own (not scaled by `activation_memory_scale`), so the model's
    logits term is taken off the measurement before the fit. A MoE proxy's workload carries the load
    its experts ran at (`moe_load`), which its activations were measured at."""
    from service.calibrate import MeasuredRun
    from service.train.proxy_scale import proxy_cluster, proxy_model, proxy_workload

    runs = []
    for t in trials:
        m = t.measured
        if t.status != "ok" or "activation_bytes_per_rank" not in m:
            continue
        logits = proxy_prediction(exp, t.plan, ModelParams(), m.moe_load).logits_bytes_per_rank or 0.0
        activations = m["activation_bytes_per_rank"] - logits
        runs.append(
            MeasuredRun(
                id=t.trial_id,
                source=source,
                model=proxy_model(exp),
                cluster=proxy_cluster(exp, t.plan.num_gpus),
                workload=proxy_workload(exp, t.plan, m.moe_load),
                plan=t.plan,
                tokens_per_s_per_gpu=m.get("tokens_per_s", 0.0) / t.plan.num_gpus or None,
                activations_bytes=activations if activations > 0 else None,
                model_state_bytes=m.get("model_state_bytes_per_rank"),
            )
        )
    return runs


def _fit(runs: list[Any], prior: ModelParams, names: tuple[str, ...]) -> ModelParams:
    from service.calibrate import fit

    return fit(runs, prior=prior, names=names).params  # type: ignore[no-any-return]


def calibrate(
    exp: ExperimentSpec,
    trials: Sequence[TrialRecord],
    prior: ModelParams,
    on_production_gpu: bool,
    source: str,
) -> tuple[ModelParams, Calibration]:
    """(calibrated parameters, what was done): memory always, time only on the production GPU type."""
    try:
        runs = measured_runs(exp, trials, source)
    except ImportError as err:
        return prior, Calibration(status=f"not calibrated: {err}", prior=prior.summary(), source=source)
    if not runs:
        why = "not calibrated: no proxy ran all its steps" if trials else "not calibrated: no proxies ran"
        return prior, Calibration(status=why, prior=prior.summary(), source=source)
    names: tuple[str, ...] = MEMORY_PARAMS + (TIME_PARAMS if on_production_gpu else ())
    params = _fit(runs, prior, MEMORY_PARAMS)  # memory and time are fitted apart (different measurements)
    if on_production_gpu:
        params = _fit(runs, params, TIME_PARAMS)
        # The time terms now rest on these proxies: the interval keeps the published set's out-of-sample
        # residuals, widened (ModelParams.widening) for the scale beyond what the proxies ran, not
        # beyond what the published runs did.
        timed = [r for r in runs if r.tokens_per_s_per_gpu]
        if timed:
            from service.calibrate.crossval import domain_of

            # The scale is the proxies' own; the GPUs and stacks the fit has seen are the published ones
            # and the proxies' together (the fit starts from, and is pulled towards, the published set).
            ran, seen = domain_of(timed), params.domain
            domain = ran.model_copy(
                update={
                    "gpu_types": sorted({*seen.gpu_types, *ran.gpu_types}),
                    "stacks": sorted({*seen.stacks, *ran.stacks}),
                }
            )
            params = params.model_copy(update={"domain": domain})
    before = {n: prior[n] for n in names}
    after = {n: params[n] for n in names}
    info = Calibration(
        status="calibrated",
        runs=len(runs),
        fitted=list(names),
        before=before,
        after=after,
        time_terms=(
            "fitted on proxies that ran on the production device type; the interval is the published "
            "set's out-of-sample residuals, widened for the scale beyond the proxies"
            if on_production_gpu
            else "kept at the published-set parameters: the proxies ran on another device, and time "
            "measured there says nothing about the production GPU"
        ),
        params=params.summary(),
        prior=prior.summary(),
        at_bounds={k: v for k, v in params.at_bounds().items() if k in names},
        source=source,
    )
    return params, info


def leave_one_out(
    exp: ExperimentSpec, trials: Sequence[TrialRecord], prior: ModelParams, source: str
) -> dict[str, Metrics]:
    """trial id → memory predictions from a fit on the other proxies (needs two or more)."""
    try:
        runs = measured_runs(exp, trials, source)
    except ImportError:
        return {}
    if len(runs) < 2:
        return {}
    loads = {t.trial_id: t.measured.moe_load for t in trials}
    out = {}
    for i, run in enumerate(runs):
        params = _fit(runs[:i] + runs[i + 1 :], prior, MEMORY_PARAMS)
        out[run.id] = proxy_prediction(exp, run.plan, params, loads.get(run.id))
    return out


def _rel_errors(pairs: list[tuple[float, float]]) -> list[float]:
    return [abs(p / m - 1.0) for p, m in pairs if m and m > 0 and p > 0]


def validation_error(
    trials: list[Any],
    loo: dict[str, Metrics],
    calibrated: bool,
    time_fitted: bool = False,
    on_cpu: bool = True,
) -> ProxyValidation:
    """Mean |predicted/measured − 1| over the proxies, per quantity, before and after calibration.

    `trials` are `ProxyTrial`s (measured, predicted_prior, predicted_calibrated); `time_fitted`: the
    proxies ran on the production device type, so the calibration fitted the time terms too;
    `on_cpu`: they ran on a CPU (their peak memory is then the process RSS)."""
    ok = [t for t in trials if t.status == "ok" and t.measured]

    def err(key: str, side: str) -> float | None:
        pairs = []
        for t in ok:
            sides = {"prior": t.predicted_prior, "calibrated": t.predicted_calibrated}
            pred = loo.get(t.trial_id, Metrics()) if side == "loo" else sides[side]
            if key in pred and key in t.measured:
                pairs.append((pred[key], t.measured[key]))
        e = _rel_errors(pairs)
        return float(np.mean(e)) if e else None

    def errors(key: str) -> ProxyError:
        return ProxyError(prior=err(key, "prior"), calibrated=err(key, "calibrated") if calibrated else None)

    activations = errors("activation_bytes_per_rank")
    activations.out_of_sample = err("activation_bytes_per_rank", "loo")
    peak = (
        "peak memory on CPU is the process RSS (runtime included): shown, not used"
        if on_cpu
        else "peak memory is the device's: shown, not used"
    )
    tokens = (
        "tokens/s: the proxies ran on the production device type, so the time terms are fitted on them"
        if time_fitted
        else "tokens/s on this device says nothing about the production GPU: shown, not used"
    )
    return ProxyValidation(
        n=len(ok),
        activation_bytes_per_rank=activations,
        model_state_bytes_per_rank=errors("model_state_bytes_per_rank"),
        peak_memory_bytes_per_rank=errors("peak_memory_bytes_per_rank"),
        tokens_per_s=errors("tokens_per_s"),
        note=(
            "mean |predicted/measured − 1| over the proxies; activations and model state are what the "
            f"calibration uses; {peak}; {tokens}"
        ),
    )


def _doublings(a: float, b: float) -> float:
    return max(0.0, math.log2(a / b)) if a > 0 and b > 0 else 0.0


def extrapolation(
    experiment: ExperimentSpec, proxy_exp: ExperimentSpec, design: ProxyDesign, measured: bool = True
) -> Extrapolation:
    """How far the production run lies from the proxies, and the memory-interval widening it earns.

    With no proxy measured (`measured` False: none asked for, or none ran all its steps) the interval
    is the prior error alone: the distance to a proxy that measured nothing earns no widening."""
    model, proxy = experiment.model, proxy_exp.proxy
    hidden = model.hidden_size // proxy.hidden_scale
    seq = proxy.seq_len or experiment.workload.seq_len
    d = {
        "layers": _doublings(model.num_layers, proxy.num_layers),
        "width": _doublings(model.hidden_size, hidden),
        "sequence": _doublings(experiment.workload.seq_len, seq),
        "gpus": _doublings(experiment.cluster.num_gpus, proxy.num_workers),
    }
    other_device = design.gpu != experiment.cluster.gpu.name
    widening = 1.0 + 0.25 * (d["width"] + d["sequence"]) + 0.125 * (d["layers"] + d["gpus"])
    widening += 0.5 if other_device else 0.0
    if not measured:
        widening = 1.0
    return Extrapolation(
        proxy=Scale(
            layers=proxy.num_layers,
            hidden_size=hidden,
            seq_len=seq,
            gpus=proxy.num_workers,
            device=design.gpu or proxy.device,
        ),
        production=Scale(
            layers=model.num_layers,
            hidden_size=model.hidden_size,
            seq_len=experiment.workload.seq_len,
            gpus=experiment.cluster.num_gpus,
            device=experiment.cluster.gpu.name,
        ),
        doublings=d,
        widening=widening,
        rule=MEMORY_RULE if measured else NO_PROXY_RULE,
    )


def memory_errors(validation: ProxyValidation, calibrated: bool) -> tuple[float, float]:
    """(e_act, e_state) for the memory interval, from the proxies' errors (floors applied)."""
    act = validation.activation_bytes_per_rank
    e_act = act.out_of_sample or (act.calibrated if calibrated else act.prior)
    state = validation.model_state_bytes_per_rank.prior
    e_act = PRIOR_ACTIVATION_ERROR if e_act is None else max(MIN_ACTIVATION_ERROR, e_act)
    e_state = PRIOR_ACTIVATION_ERROR if state is None else max(MIN_STATE_ERROR, state)
    return e_act, e_state
