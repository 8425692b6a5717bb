"""`Preflight` without Ray: what it measures (the production run's own sequence, vocabulary, warm steps and
plan under the given parameters), what it predicts beside it, and what it records when a run fails or
diverges (service/preflight/first_hour.py, verdict.py, ab.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from service.calibrate.crossval import calibrate
from service.calibrate.runs import load_runs
from service.costmodel.estimate import estimate
from service.planner import Planner
from service.preflight.first_hour import RESULT_FILE, Preflight
from service.preflight.record import runs_document, write_runs_file
from service.preflight.verdict import default_thresholds
from service.spec import load_experiment
from service.spec.errors import SpecError
from service.spec.param_bands import PUBLISHED_FIT_PARAMS
from service.spec.params import ModelParams, load_params, save_params
from service.train.production import ProductionResult, ProductionRun, choose_plan, full_scale
from service.train.trainer import worker_config

TINY = "experiments/tiny-cpu.yaml"
GOOD = {"tokens_per_s": 4800.0, "step_time_s": 0.1, "measured_peak_memory_bytes_per_rank": 6e8}
PROBE = {"collectives": {"scopes": {}}, "checkpoint": {"bytes": 1e7, "save_s": 0.01, "load_s": 0.01}}


@pytest.fixture(scope="module")
def cold_params(tmp_path_factory) -> Path:
    """A set calibrated on one preflight row 25 % slower than predicted, without cross-validation: it
    has no out-of-sample interval, and on the tiny experiment it selects another plan than the shipped."""
    spec = full_scale(load_experiment(TINY))
    plan = choose_plan(spec)
    predicted = estimate(spec.model, spec.cluster, plan, spec.workload).tokens_per_s
    doc = runs_document(spec, plan, "fp32", 0.75 * predicted, run_id="pf", when="2026-12-07")
    runs = load_runs(write_runs_file(doc, tmp_path_factory.mktemp("runs")))
    params, _ = calibrate(runs, ModelParams(), PUBLISHED_FIT_PARAMS, name="pf", crossval=False)
    return save_params(params, tmp_path_factory.mktemp("params") / "pf.yaml")


def _preflight(tmp_path: Path, **kw) -> Preflight:
    return Preflight(TINY, track=False, out_dir=tmp_path / "out", storage_path=tmp_path / "st", **kw)


def _run(plan, run_dir: Path, status="ok", steps=5, losses=(6.2, 6.1), **metrics) -> ProductionResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    return ProductionResult(
        plan=plan,
        status=status,
        reason="" if status == "ok" else "out of memory at step 2",
        steps=steps,
        losses=list(losses),
        restarts=0,
        run_dir=str(run_dir),
        mlflow_run_id=None,
        wall_s=1.0,
        last_metrics={**GOOD, **metrics},
    )


def test_the_full_scale_run_measures_the_workloads_sequence_and_the_models_vocabulary():
    spec = load_experiment(TINY)
    proxy = spec.proxy.model_copy(update={"seq_len": 16, "vocab_size": 128})
    short = spec.model_copy(update={"proxy": proxy})
    full = full_scale(short)
    worker = worker_config(full, choose_plan(spec), run_dir="/nowhere")
    assert worker.seq_len == spec.workload.seq_len != 16
    assert worker.model.vocab_size == spec.model.vocab_size != 128


def test_steps_must_leave_a_timed_step_after_the_warm_up(tmp_path):
    warmup = load_experiment(TINY).proxy.warmup_steps
    with pytest.raises(SpecError) as err:
        _preflight(tmp_path, steps=warmup)
    assert err.value.field == "--steps" and "warm-up" in err.value.message
    assert _preflight(tmp_path, steps=warmup + 1).steps == warmup + 1


def test_an_unwritable_out_folder_is_refused_before_the_run(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(SpecError) as err:
        Preflight(TINY, track=False, out_dir=tmp_path / "afile" / "out", storage_path=tmp_path / "st")
    assert err.value.field == "--out"


def test_the_plan_under_test_is_the_one_chosen_under_the_given_parameters(tmp_path, cold_params):
    shipped = Planner(TINY, top_k=0).fit().selected.plan
    chosen = Planner(TINY, top_k=0, params=cold_params).fit().selected.plan
    assert chosen.short() != shipped.short()  # the set moves the choice, so the test can fail
    preflight = _preflight(tmp_path, params=cold_params)
    assert preflight.plan.short() == chosen.short()
    # the worker's prediction is the thresholds' estimate: the experiment's cluster, the same parameters
    spec = preflight.experiment
    predicted = estimate(spec.model, spec.cluster, chosen, spec.workload, params=preflight.params)
    worker = preflight.production.predicted()
    assert worker["predicted_tokens_per_s"] == pytest.approx(predicted.tokens_per_s)
    peak = worker["predicted_peak_memory_bytes_per_rank"]
    assert peak == pytest.approx(predicted.memory_per_gpu_bytes.total)


def test_a_set_without_an_interval_keeps_the_shipped_interval_width(tmp_path, cold_params):
    spec, plan = full_scale(load_experiment(TINY)), choose_plan(load_experiment(TINY))
    given = default_thresholds(spec, plan, load_params(cold_params))
    own = estimate(spec.model, spec.cluster, plan, spec.workload, params=load_params(cold_params))
    shipped = estimate(spec.model, spec.cluster, plan, spec.workload)
    assert own.tokens_per_s_interval[0] == own.tokens_per_s  # the set has no interval of its own
    width = shipped.tokens_per_s_interval[0] / shipped.tokens_per_s
    assert width < 0.95 and given.min_tokens_per_s == pytest.approx(own.tokens_per_s * width)
    assert "shipped set's 80 % interval width" in given.sources["min_tokens_per_s"]


def test_a_failed_ab_plan_did_not_run_faster_and_is_not_recorded(tmp_path):
    preflight = _preflight(tmp_path)
    other_plan = Planner(TINY, top_k=3).fit().ranked[1].plan
    mine = _run(preflight.plan, tmp_path / "a")
    other = _run(other_plan, tmp_path / "b", status="failed", steps=2, tokens_per_s=9000.0)
    result = preflight._result(mine, PROBE, 1.0, other)
    assert "faster" not in result.ab["line"] and "failed" in result.ab["line"]
    ids = [m["id"] for m in yaml.safe_load(Path(result.runs_file).read_text())["measurements"]]
    assert ids == [preflight.run_name]  # the chosen plan's row only


def test_a_failed_production_run_writes_no_measurement(tmp_path):
    preflight = _preflight(tmp_path)
    result = preflight._result(_run(preflight.plan, tmp_path / "a", status="failed", steps=2), PROBE, 1.0)
    assert result.runs_file is None and result.verdict.startswith("NO-GO: run failed")


def test_a_diverged_loss_is_no_go_and_the_result_file_is_strict_json(tmp_path):
    preflight = _preflight(tmp_path)
    result = preflight._result(_run(preflight.plan, tmp_path / "a", losses=(6.2, math.nan)), PROBE, 1.0)
    assert "loss is nan" in result.verdict
    text = (preflight.out_dir / RESULT_FILE).read_text()
    doc = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-standard JSON {token}"))
    assert doc["production"]["final_loss"] is None


def test_a_gpu_outside_the_catalog_still_gets_its_verdict_written(tmp_path):
    preflight = _preflight(tmp_path)
    gpu = preflight.experiment.cluster.gpu.model_copy(update={"name": "my-epyc-box"})
    cluster = preflight.experiment.cluster.model_copy(update={"gpu": gpu})
    preflight.experiment = preflight.experiment.model_copy(update={"cluster": cluster})
    result = preflight._result(_run(preflight.plan, tmp_path / "a"), PROBE, 1.0)
    assert result.runs_file is None and any(n.startswith("no runs file: ") for n in result.notes)
    assert (preflight.out_dir / RESULT_FILE).is_file()


def test_the_prediction_beside_a_production_run_prices_its_own_cluster():
    run = ProductionRun("experiments/llama2-13b-32xh100.yaml", track=False)  # 4 nodes, not one of 32
    full = run.experiment
    expected = estimate(full.model, full.cluster, run.plan, full.workload).tokens_per_s
    assert run.predicted()["predicted_tokens_per_s"] == pytest.approx(expected)
