"""One ranking function (`service.planner.rank_plans`) behind the Python API (`Planner`), the CLI's
`plan`, and `run`'s scoring (`design.decide.score`, which adds goodput and keeps to the engines it
launches): the same inputs give the same table and the same choice on every path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from service.design.decide import LAUNCHED_ENGINES, score
from service.design.finish import assumptions
from service.planner import Planner, rank_plans
from service.report.proxy_records import Calibration, ProxyDesign
from service.spec import load_experiment
from service.spec.params import load_params
from service.spec.plan_table import ENGINE_CODES

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "experiments" / "llama2-13b-32xh100.yaml"
MOE = REPO / "experiments" / "qwen3-30b-a3b-64xh100.yaml"


def _ranking(spec, **kwargs):
    return rank_plans(spec.model, spec.cluster, spec.workload, spec.budget, params=load_params(None),
                      engines=spec.engines, **kwargs)  # fmt: skip


def test_the_api_and_the_cli_choose_what_rank_plans_chooses():
    spec = load_experiment(SEED)
    ranking = _ranking(spec)
    chosen = ranking.enumeration.plans.row(int(ranking.selection.order[0]))
    assert Planner(SEED).fit().selected.plan == chosen  # type: ignore[union-attr]
    cli = subprocess.run([sys.executable, "-m", "service", "plan", str(SEED), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert json.loads(cli.stdout)["selected"]["label"] == chosen.short()


def test_run_scores_with_the_same_ranking_plus_goodput():
    spec = load_experiment(SEED)
    scored = score(spec.model, spec.cluster, spec.workload, spec.budget, load_params(None), spec.goodput)
    ranking = _ranking(spec, goodput=spec.goodput, time_unfit=True)  # the memo prints unfit plans too
    assert np.array_equal(scored.selection.order, ranking.selection.order)
    assert np.array_equal(scored.est.dollars, ranking.estimates.dollars)
    # goodput only lengthens the run: the failure-free hours are the plain ranking's
    plain = _ranking(spec, time_unfit=True)
    assert np.array_equal(scored.hours_no_failures, plain.estimates.hours)
    assert (scored.est.hours >= plain.estimates.hours).all() and (
        scored.est.hours > plain.estimates.hours
    ).any()
    # `plan` times only the plans that fit: the others lose on memory, with no time to read, and the
    # choice and every timed number are the same
    lean = _ranking(spec, goodput=spec.goodput)
    fits = lean.estimates.fits
    assert 0 < fits.sum() < len(fits) and np.isnan(lean.estimates.hours[~fits]).all()
    assert np.array_equal(lean.selection.order, ranking.selection.order)
    assert np.array_equal(lean.estimates.dollars[fits], ranking.estimates.dollars[fits])


def test_run_keeps_to_the_engines_it_launches_and_says_so():
    spec = load_experiment(MOE)
    scored = score(spec.model, spec.cluster, spec.workload, spec.budget, load_params(None), spec.goodput)
    assert {scored.plans.row(int(r)).engine for r in scored.selection.order[:50]} == set(LAUNCHED_ENGINES)
    ranked = np.unique(_ranking(spec).enumeration.plans.engine)
    assert {ENGINE_CODES[c] for c in ranked} == set(spec.engines)  # `plan` ranks all three
    # what `assumptions` reads of a result
    result = SimpleNamespace(calibration=Calibration(), proxy_design=ProxyDesign())
    rows = assumptions(result, spec)  # type: ignore[arg-type]
    assert rows[-1].what == "plans of deepspeed only"
    assert rows[-1].source == (
        "the engines run proves on proxies and launches; `python -m service plan` ranks megatron, fsdp too"
    )
