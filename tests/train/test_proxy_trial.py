"""Trial outcomes: failure classification, the step log, the proxy scale and the cost model's side."""

from __future__ import annotations

import json
import math

import pytest

from service.spec import Plan, load_experiment
from service.train.proxy_scale import (
    PREDICTED_QUANTITIES,
    predict_proxy,
    proxy_cluster,
    proxy_model,
    proxy_plan_problem,
    proxy_workload,
)
from service.train.proxy_trial import classify_failure, read_log


@pytest.fixture(scope="module")
def tiny():
    return load_experiment("experiments/tiny-cpu.yaml")


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory"),
            "oom",
        ),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (MemoryError(), "oom"),
        (
            RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv"),
            "failed",
        ),
        (AssertionError("Check batch related parameters. train_batch_size is not equal"), "invalid"),
        (ValueError("something else broke\nin two lines"), "failed"),
    ],
)
def test_classify_failure(error, status):
    got, reason = classify_failure(error)
    assert got == status
    assert reason and "\n" not in reason


def test_classify_failure_reads_chained_causes():
    try:
        try:
            raise MemoryError("allocation failed")
        except MemoryError as inner:
            raise RuntimeError("worker group failed") from inner
    except RuntimeError as err:
        assert classify_failure(err)[0] == "oom"
    assert "timed out" in classify_failure("Timed out waiting 5000ms")[1]


def test_read_log_keeps_the_last_record_of_each_step_and_counts_restarts(tmp_path):
    lines = [
        {"event": "start", "step": 0, "time": 1.0},
        {"event": "step", "step": 1, "loss": 6.0, "time": 2.0},
        {"event": "step", "step": 2, "loss": 5.9, "time": 3.0},
        {"event": "start", "step": 1, "time": 4.0},  # restarted from the step-1 checkpoint
        {"event": "step", "step": 2, "loss": 5.8, "time": 5.0},
    ]
    (tmp_path / "proxy_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records, restarts = read_log(tmp_path)
    assert [r["loss"] for r in records] == [6.0, 5.8] and restarts == 1
    assert read_log(tmp_path / "missing") == ([], 0)


def test_proxy_scale_keeps_the_plan_shape(tiny):
    model = proxy_model(tiny)
    assert model.num_layers == tiny.proxy.num_layers and model.hidden_size == tiny.model.hidden_size
    cluster = proxy_cluster(tiny)
    assert cluster.num_gpus == 2 and cluster.gpu.name == "cpu"
    plan = Plan(dp=2, micro_batch=3, grad_accum=2)
    work = proxy_workload(tiny, plan)
    assert work.batch_sequences == 12 and work.seq_len == tiny.workload.seq_len
    assert proxy_plan_problem(tiny, plan) is None
    assert "workers" in proxy_plan_problem(tiny, Plan(dp=1))


def test_prediction_has_every_key_and_sane_values(tiny):
    got = predict_proxy(tiny, Plan(dp=2, zero_stage=1, micro_batch=2, grad_accum=2))
    assert set(got) == set(PREDICTED_QUANTITIES)
    assert all(math.isfinite(v) for _, v in got.items())
    assert got.model_state_bytes_per_rank > 0 and got.fits == 1.0
    # fp32 on CPU: at least 4 bytes of weights per parameter on every rank under ZeRO-1
    assert got["model_state_bytes_per_rank"] >= 4 * proxy_model(tiny).num_params


def test_proxies_are_timed_without_the_published_frameworks_overheads(tiny):
    from service.costmodel import estimate
    from service.spec.params import load_params
    from service.train.proxy_scale import FRAMEWORK_OVERHEADS, proxy_params, proxy_plan

    shipped, proxy = load_params(), proxy_params()
    assert shipped["step_overhead_s"] > 0.01  # fitted on published runs (v11: 0.063 s)
    assert all(proxy[k] == 0.0 for k in FRAMEWORK_OVERHEADS)
    assert {k: proxy[k] for k in proxy.values if k not in FRAMEWORK_OVERHEADS} == {
        k: shipped[k] for k in shipped.values if k not in FRAMEWORK_OVERHEADS
    }
    plan = Plan(dp=2, zero_stage=0, micro_batch=4)
    args = (proxy_model(tiny), proxy_cluster(tiny, 2), proxy_plan(tiny, plan), proxy_workload(tiny, plan))
    with_overhead = estimate(*args, params=shipped).step_time_s
    got = predict_proxy(tiny, plan).step_time_s
    assert got == pytest.approx(with_overhead - shipped["step_overhead_s"] - shipped["microstep_overhead_s"])


def test_another_launcher_gets_every_worker_config_and_a_failure_is_classified(tiny, tmp_path):
    """`run_proxy(launch=...)` hands the launcher what each worker receives, how many there are and the
    restarts it may make, and classifies what it raises as it would Ray Train's error."""
    from service.train.proxy_trial import run_proxy

    plan = Plan(dp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32")
    seen = []

    def launch(config, workers, restarts):
        seen.append((config, workers, restarts))
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    result = run_proxy(tiny, plan, steps=2, storage_path=str(tmp_path), run_name="local", launch=launch)
    assert result.status == "oom" and result.losses == []
    run_proxy(
        tiny, plan, inject_failure_at_step=2, storage_path=str(tmp_path), run_name="kill", launch=launch
    )
    (config, workers, restarts), (injected, _, one) = seen
    assert workers == 2 and config.plan.dp == 2 and config.steps == 2 and restarts == 0
    assert config.run_dir == str(tmp_path / "local") and (tmp_path / "local").is_dir()
    # an injected failure: a checkpoint every step and one restart, as under Ray Train
    assert injected.inject_failure_at_step == 2 and injected.checkpoint_every == 1 and one == 1


def test_a_step_log_line_cut_by_a_killed_worker_is_dropped_and_the_next_record_kept(tmp_path):
    from service.train.proxy_trial import LOG_FILE

    step = lambda n: json.dumps({"event": "step", "step": n, "loss": 6.0, "time": 0.0, "metrics": {}})  # noqa: E731
    start = json.dumps({"event": "start", "step": 1, "time": 0.0, "phases": {}})
    # rank 0 died writing step 2; the restarted worker appended its start record to the cut line
    (tmp_path / LOG_FILE).write_text(
        json.dumps({"event": "start", "step": 0, "time": 0.0, "phases": {}}) + "\n"
        + step(1) + "\n" + step(2)[:25] + start + "\n" + step(2) + "\n"
    )  # fmt: skip
    records, restarts = read_log(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and restarts == 1
