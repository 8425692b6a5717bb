"""Proxy trials (2 CPU workers, gloo): every ZeRO stage, offload, TP 2, PP 2, recompute, bitwise resume
after an injected failure, OOM, a killed worker, invalid plans and a hanging collective.

Everything Ray Train does runs on a local Ray: its restart from the latest checkpoint (z1, through
`python -m service proxy-run --json` in its own process, whose stdout must stay one JSON document), the
failures, and two plans trained whole (z1, z3-offload). The other plan kinds, and the ZeRO-3 offload
plan's resume (its checkpoint, not Ray's restart, is what differs), run the same worker loop in local
processes (local_workers.py: what the layout shards, saves and restores is under test, not how Ray
starts it). Each plan runs once (cached) however many tests read it.
"""

from __future__ import annotations

import pytest

from service.spec import Plan, load_experiment
from service.train.proxy_trial import ProxyResult, ensure_ray, run_proxy
from tests.train import local_workers

pytestmark = pytest.mark.slow

STEPS = 3  # also the resume tests' length: their references are the z1 and z3-offload trials
ON_RAY = ("z1", "z3-offload")  # trained under Ray Train; the others in local processes
# Eight trials cover the matrix (kinds are combined, each trial being a few processes' start-up):
# ZeRO 0-3, optimizer+parameter offload, TP 2, PP 2, recompute none/selective/full.
PLANS = {
    "z0-selective": Plan(
        dp=2, zero_stage=0, micro_batch=2, grad_accum=2, recompute="selective", precision="fp32"
    ),
    "z1": Plan(dp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32"),
    "z2-full": Plan(dp=2, zero_stage=2, micro_batch=2, grad_accum=2, recompute="full", precision="fp32"),
    "z3-offload": Plan(
        dp=2,
        zero_stage=3,
        offload_optimizer=True,
        offload_params=True,
        micro_batch=2,
        grad_accum=2,
        precision="fp32",
    ),
    "tp2": Plan(dp=1, tp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32"),
    "pp2": Plan(dp=1, pp=2, zero_stage=1, micro_batch=2, grad_accum=2, precision="fp32"),
    # Issue #11's two gaps: offload's largest-parameter staging buffers were counted as gradients
    # (+5 %), and with one micro-batch the last pipeline stage (logits) holds more than rank 0 (-14 %).
    "z2-offload-ga1": Plan(
        dp=2, zero_stage=2, offload_optimizer=True, micro_batch=2, grad_accum=1, precision="fp32"
    ),
    "pp2-ga1": Plan(dp=1, pp=2, zero_stage=1, micro_batch=2, grad_accum=1, precision="fp32"),
}


@pytest.fixture(scope="module")
def experiment():
    exp = load_experiment("experiments/tiny-cpu.yaml")
    proxy = exp.proxy.model_copy(update={"steps": STEPS, "warmup_steps": 1})
    return exp.model_copy(update={"proxy": proxy})


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ensure_ray(num_cpus=2)  # local, on 127.0.0.1, with RAY_ADDRESS set for its own processes
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def trial(ray_session, experiment, tmp_path_factory, shared_trials):
    """`trial(name)`: the result of running PLANS[name] once in this session (conftest.shared_trials)."""
    storage = str(tmp_path_factory.mktemp("proxy"))

    def get(name: str) -> ProxyResult:
        launch = None if name in ON_RAY else local_workers.launch
        return shared_trials.trial(experiment, PLANS[name], storage, name, STEPS, launch)

    return get


@pytest.mark.parametrize("name", list(PLANS))
def test_every_plan_kind_trains_and_reports_measurements(trial, name):
    result = trial(name)
    assert result.status == "ok", result.reason
    assert len(result.losses) == STEPS and result.restarts == 0
    # a fresh 512-token model starts near ln(512) = 6.24
    assert all(5.5 < loss < 7.0 for loss in result.losses), result.losses
    m = result.measured
    assert m["tokens_per_s"] > 0 and m["step_time_s"] > 0
    assert m["model_state_bytes_per_rank"] > 0 and m["activation_bytes_per_rank"] > 0
    assert m["peak_memory_bytes_per_rank"] > m["model_state_bytes_per_rank"]
    assert set(result.predicted) >= {
        "tokens_per_s",
        "model_state_bytes_per_rank",
        "activation_bytes_per_rank",
    }


def test_zero_stages_shard_what_they_promise(trial):
    z0, z1, z2, z3 = (trial(n).measured for n in ("z0-selective", "z1", "z2-full", "z3-offload"))
    params_fp32 = z0["params_bytes_per_rank"]
    assert params_fp32 == 857_216 * 4  # every parameter of the 4-layer tiny Llama, fp32
    assert z0["optimizer_bytes_per_rank"] == pytest.approx(2 * params_fp32, rel=0.001)  # Adam moments
    for z in (z1, z2, z3):
        assert z["optimizer_bytes_per_rank"] == pytest.approx(
            params_fp32, rel=0.01
        )  # moments halved over dp=2
    assert z1["params_bytes_per_rank"] == z2["params_bytes_per_rank"] == params_fp32
    assert z3["params_bytes_per_rank"] == pytest.approx(params_fp32 / 2, rel=0.01)
    # ZeRO-2's partitioned gradients; a parameter cut by the partition boundary keeps a little more (~4 %)
    assert z2["grads_bytes_per_rank"] == pytest.approx(params_fp32 / 2, rel=0.05)
    assert z1["grads_bytes_per_rank"] == params_fp32  # ZeRO-1 holds full gradients until the boundary
    assert (
        z3["model_state_bytes_per_rank"] < z1["model_state_bytes_per_rank"] < z0["model_state_bytes_per_rank"]
    )


def test_same_data_same_model_gives_the_same_first_loss_across_layouts(trial):
    # dp=2 plans see the same global batch, so their first losses agree to float rounding; tp/pp (dp=1)
    # read only the first half of it.
    firsts = [trial(n).losses[0] for n in ("z0-selective", "z1", "z2-full", "z3-offload")]
    assert max(firsts) - min(firsts) < 1e-5
    assert trial("tp2").losses[0] == pytest.approx(trial("pp2").losses[0], abs=1e-4)


def test_recompute_cuts_saved_activations(trial):
    none = trial("z1").measured["activation_bytes_per_rank"]
    selective = trial("z0-selective").measured["activation_bytes_per_rank"]
    full = trial("z2-full").measured["activation_bytes_per_rank"]
    assert full < selective < none
    assert full < 0.5 * none


def test_tp2_shards_the_linear_layers(trial):
    assert (
        trial("tp2").measured["params_bytes_per_rank"] < 0.6 * trial("z1").measured["params_bytes_per_rank"]
    )


def test_pp2_stage_holds_half_the_layers(trial):
    assert (
        trial("pp2").measured["params_bytes_per_rank"] < 0.6 * trial("z1").measured["params_bytes_per_rank"]
    )


def test_resume_after_injected_failure_is_bitwise_identical(trial, experiment, tmp_path):
    """ZeRO-3 with offload, killed at step 2 and restarted from its step-1 checkpoint (local workers:
    its checkpoint, not Ray's restart, is what differs from z1's, below)."""
    reference = trial("z3-offload")
    resumed = run_proxy(
        experiment,
        PLANS["z3-offload"],
        steps=STEPS,
        inject_failure_at_step=2,
        checkpoint_every=1,
        storage_path=str(tmp_path),
        run_name="z3-offload-resumed",
        launch=local_workers.launch,
    )
    assert resumed.status == "ok", resumed.reason
    assert resumed.restarts == 1
    assert (tmp_path / "z3-offload-resumed" / "injected_failure.done").exists()
    assert resumed.losses == reference.losses  # bitwise: float equality, not approx


def test_ray_trains_restart_resumes_bitwise_and_the_clis_json_stays_one_document(trial, experiment, tmp_path):
    """z1 through `python -m service proxy-run --json` in its own process (its real stdout is what is
    checked, not pytest's capture), one worker killed at step 2: Ray Train restarts the worker group
    from the step-1 checkpoint, the losses equal the uninterrupted z1 trial's bitwise, and stdout is
    one JSON document although Ray prints "(raylet) A worker died ..." on the driver's stdout."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    reference = trial("z1")
    exp = tmp_path / "experiment.yaml"  # tiny-cpu as the module's `experiment` fixture shapes it
    exp.write_text(yaml.safe_dump(experiment.model_dump(mode="json")))
    plan = ["--tp", "1", "--pp", "1", "--zero", "1", "--micro-batch", "2", "--grad-accum", "2",
            "--recompute", "none", "--precision", "fp32", "--steps", str(STEPS)]  # fmt: skip
    runs = tmp_path / "runs"
    kill = ["--inject-failure-at-step", "2", "--checkpoint-every", "1", "--storage-path", str(runs)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, as a user's
    proc = subprocess.run(
        [sys.executable, "-m", "service", "proxy-run", str(exp), *plan, *kill, "--json"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    data = json.loads(proc.stdout)  # the whole of stdout: one document, nothing before or after it
    assert proc.returncode == 0, (data["reason"], proc.stderr[-2000:])
    assert data["status"] == "ok" and data["restarts"] == 1
    assert next(runs.glob("*/injected_failure.done"))  # a worker really was killed
    assert data["losses"] == reference.losses  # bitwise: float equality, not approx
    # what the command reports: the plan its flags describe, its DeepSpeed config, measured beside predicted
    assert (
        data["plan"]["dp"] == 2 and data["ds_config"]["zero_optimization"]["stage"] == 1
    )  # 2 workers / tp·pp
    summary = {
        "tokens_per_s",
        "model_state_bytes_per_rank",
        "activation_bytes_per_rank",
        "peak_memory_bytes_per_rank",
    }
    assert set(data["measured"]) >= summary and set(data["predicted"]) >= summary
    assert data["measured"]["model_state_bytes_per_rank"] > 0


def test_plan_over_the_memory_cap_is_reported_as_oom(ray_session, experiment, tmp_path):
    capped = experiment.model_copy(
        update={"proxy": experiment.proxy.model_copy(update={"memory_limit_gib": 0.05})}
    )
    big = Plan(dp=2, zero_stage=0, micro_batch=64, grad_accum=1, precision="fp32")
    result = run_proxy(capped, big, steps=2, storage_path=str(tmp_path), run_name="oom")
    assert result.status == "oom", result.reason
    assert result.reason


def test_a_worker_killed_mid_run_is_reported_as_killed_not_oom(ray_session, experiment, tmp_path):
    """SIGKILL to one worker while its rank stalls at step 2: Ray's message for the dead worker names
    "the OOM killer" among its guesses, which is no evidence of memory (issue #35)."""
    import os
    import signal
    import threading
    import time

    psutil = pytest.importorskip("psutil")
    log = tmp_path / "killed" / "proxy_log.jsonl"
    killed: list[int] = []

    def kill_a_worker() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not killed:
            time.sleep(0.5)
            if not log.is_file() or '"step"' not in log.read_text():
                continue  # not training yet: wait for step 1's record
            for proc in psutil.Process(os.getpid()).children(recursive=True):  # this session's Ray only
                try:
                    if "RayTrainWorker" in " ".join(proc.cmdline()):
                        os.kill(proc.pid, signal.SIGKILL)
                        killed.append(proc.pid)
                        return
                except (psutil.Error, ProcessLookupError):
                    continue

    killer = threading.Thread(target=kill_a_worker, daemon=True)
    killer.start()
    result = run_proxy(
        experiment,
        PLANS["z1"],
        steps=STEPS,
        storage_path=str(tmp_path),
        run_name="killed",
        stall={"rank": 1, "step": 2, "seconds": 60},
    )
    killer.join(5)
    assert killed, "no worker was found to kill"
    assert result.status == "killed", result.reason
    assert "OOM" not in result.reason and result.wall_s < 60 + 60


def test_invalid_plans_are_reported_not_run(experiment):
    four = experiment.model_copy(update={"proxy": experiment.proxy.model_copy(update={"num_workers": 4})})
    tp4 = run_proxy(four, Plan(dp=1, tp=4, zero_stage=1, precision="fp32"))
    assert tp4.status == "invalid" and "num_key_value_heads" in tp4.reason  # tiny-cpu has 2 KV heads
    too_many = run_proxy(experiment, Plan(dp=4, zero_stage=1, precision="fp32"))
    assert too_many.status == "invalid" and "workers" in too_many.reason
    assert too_many.losses == [] and too_many.measured == {}


def test_hanging_collective_ends_with_a_timeout(ray_session, experiment, tmp_path):
    quick = experiment.model_copy(
        update={"proxy": experiment.proxy.model_copy(update={"collective_timeout_s": 6})}
    )
    result = run_proxy(
        quick,
        PLANS["z1"],
        steps=2,
        storage_path=str(tmp_path),
        run_name="hang",
        stall={"rank": 1, "step": 1, "seconds": 120},
    )
    assert result.status == "failed"
    assert "timed out" in result.reason.lower() or "timeout" in result.reason.lower(), result.reason
    assert result.wall_s < 100  # the 120 s stall did not run out: the timeout ended the trial


# Measured vs the cost model at proxy scale: model state within 1 %, saved activations within 10 %.
# Every case agrees since the model took in what these runs measured (HF SDPA attention's saved tensors,
# the whole embedding on every TP rank, ZeRO-3 offload's two gradient partitions, the full-recompute
# peak without the loss tensors, attention-sub-block selective recompute). A future disagreement gets a
# `pytest.mark.xfail(strict=True, reason="cost model: ...")` here, never a looser tolerance.
MODEL_STATE_CASES: dict[str, list] = {name: [] for name in PLANS}
ACTIVATION_CASES: dict[str, list] = {name: [] for name in PLANS}


def _case(name: str, marks: dict[str, list]) -> pytest.param:
    return pytest.param(name, marks=marks[name], id=name)


@pytest.mark.parametrize("name", [_case(n, MODEL_STATE_CASES) for n in PLANS])
def test_model_state_bytes_match_the_cost_model_within_1_percent(trial, name):
    result = trial(name)
    measured = result.measured["model_state_bytes_per_rank"]
    predicted = result.predicted["model_state_bytes_per_rank"]
    assert measured == pytest.approx(predicted, rel=0.01), (
        f"measured {measured:.0f} predicted {predicted:.0f}"
    )


@pytest.mark.parametrize("name", [_case(n, ACTIVATION_CASES) for n in PLANS])
def test_activation_bytes_match_the_cost_model_within_10_percent(trial, name):
    result = trial(name)
    measured = result.measured["activation_bytes_per_rank"]
    predicted = result.predicted["activation_bytes_per_rank"]
    assert measured == pytest.approx(predicted, rel=0.10), (
        f"measured {measured:.0f} predicted {predicted:.0f}"
    )
