"""`run`'s calibration on proxies that ran on the production GPU type: the time terms are refit on them,
so the production estimate's interval widens for the scale beyond the proxies, not beyond the published
runs (service/design/calibration.py)."""

from __future__ import annotations

from service.design.calibration import calibrate
from service.search.result import TrialRecord
from service.spec import load_experiment
from service.spec.params import load_params
from service.train.production import choose_plan, full_scale
from service.train.proxy_scale import proxy_cluster


def _trials(exp, plan) -> list[TrialRecord]:
    measured = {"tokens_per_s": 4000.0, "activation_bytes_per_rank": 2e8, "model_state_bytes_per_rank": 1e8}
    return [
        TrialRecord(trial_id=f"t{i}", key=plan.short(), plan=plan, status="ok", steps=5, measured=measured)
        for i in range(2)
    ]


def test_a_time_fit_on_proxies_widens_the_interval_beyond_their_scale():
    exp = load_experiment("experiments/tiny-cpu.yaml")
    plan = choose_plan(exp)
    published = load_params()
    params, info = calibrate(exp, _trials(exp, plan), published, on_production_gpu=True, source="proxies")
    assert params.domain.max_gpus == proxy_cluster(exp, plan.num_gpus).num_gpus < published.domain.max_gpus
    # the GPUs and stacks seen stay the published ones, the proxies' added
    assert set(published.domain.stacks) < set(params.domain.stacks)
    assert set(published.domain.gpu_types) <= set(params.domain.gpu_types)
    assert (
        params.residuals == published.residuals
        and "widened for the scale beyond the proxies" in info.time_terms
    )
    full = full_scale(exp).cluster
    beyond = full.num_gpus * 16  # four doublings beyond the proxies (the published set: the CPU is unseen)
    assert params.widening(beyond, exp.workload.seq_len, full.gpu.name) > published.widening(
        beyond, exp.workload.seq_len, full.gpu.name
    )
    kept, _ = calibrate(exp, _trials(exp, plan), published, on_production_gpu=False, source="proxies")
    assert kept.domain == published.domain  # time terms not refit: the published set's domain
