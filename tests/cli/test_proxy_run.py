"""`python -m service proxy-run`: the issue's command end to end, invalid flags, bad input."""

from __future__ import annotations

import json

import pytest

from service.cli.main import main

EXP = "experiments/tiny-cpu.yaml"
PLAN = [
    "--tp",
    "1",
    "--pp",
    "1",
    "--zero",
    "1",
    "--micro-batch",
    "2",
    "--grad-accum",
    "2",
    "--recompute",
    "none",
]
SUMMARY = {
    "tokens_per_s",
    "model_state_bytes_per_rank",
    "activation_bytes_per_rank",
    "peak_memory_bytes_per_rank",
}


@pytest.fixture
def own_ray():
    yield
    import ray

    ray.shutdown()


@pytest.mark.slow
def test_issue_command_runs_a_trial_and_prints_json(capsys, own_ray, tmp_path):
    # 3 steps: tiny-cpu times the steps after its 2 warmup steps (--steps 2 would time none: exit 2).
    code = main(["proxy-run", EXP, *PLAN, "--steps", "3", "--storage-path", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0, data["reason"]
    assert data["status"] == "ok" and data["restarts"] == 0
    assert len(data["losses"]) == 3 and all(5.0 < x < 7.5 for x in data["losses"])
    assert set(data["measured"]) >= SUMMARY and set(data["predicted"]) >= SUMMARY
    assert data["measured"]["model_state_bytes_per_rank"] > 0
    assert data["ds_config"]["zero_optimization"]["stage"] == 1
    assert data["plan"]["dp"] == 2  # 2 workers / (tp·pp)


def test_plan_deepspeed_cannot_run_is_invalid_not_a_crash(capsys):
    code = main(["proxy-run", EXP, *PLAN, "--offload-params", "--json"])  # needs ZeRO-3
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert code == 2  # bad input, as everywhere else
    assert len(err.splitlines()) == 1 and err.startswith("error: offload_params: ")
    assert data["status"] == "invalid" and "zero_stage 3" in data["reason"]
    assert data["reason"].startswith("offload_params: ")  # the field at fault
    from service.train.proxy_trial import ProxyResult

    assert set(data) == set(ProxyResult.model_fields)  # the same document as a run's, with plan None
    assert data["plan"] is None and data["losses"] == [] and data["measured"] == {}


def test_workers_not_divisible_by_tp_pp_is_invalid(capsys):
    code = main(["proxy-run", EXP, *PLAN[:2], "--pp", "2", *PLAN[4:], "--workers", "3", "--json"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert code == 2 and data["status"] == "invalid" and len(err.splitlines()) == 1
    assert data["reason"] == "dp·tp·pp = 2 but the proxy has 3 workers"  # proxy_plan_problem's rule


@pytest.mark.parametrize(
    ("flag", "value"), [("--micro-batch", "-1"), ("--grad-accum", "0"), ("--workers", "-2"), ("--tp", "x")]
)
def test_a_count_that_is_not_positive_is_one_line_naming_the_flag_exit_2(capsys, flag, value):
    argv = ["proxy-run", EXP, *PLAN, flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"argument {flag}:" in err


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [("--steps", "2", "no timed step"), ("--workers", "1000000000", "at most 1,024"), ("--tp", "-1e9", "")],
)
def test_steps_workers_and_negative_numbers_are_refused_naming_the_flag(capsys, flag, value, fragment):
    argv = ["proxy-run", EXP, *PLAN, flag, value]
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's type check (--tp takes a positive integer)
        code = exit_.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and flag in err and fragment in err


def test_missing_experiment_is_one_line_exit_2(capsys):
    assert main(["proxy-run", "nope.yaml", *PLAN]) == 2
    err = capsys.readouterr().err
    assert "nope.yaml" in err and len(err.strip().splitlines()) == 1
