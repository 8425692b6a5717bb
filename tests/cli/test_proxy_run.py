"""`python -m service proxy-run`: invalid flags and bad input, each one line naming the flag. The
command end to end (a real trial with a killed worker, its JSON on a real stdout) is in
tests/train/test_proxy_ray.py (`test_ray_trains_restart_resumes_bitwise_and_the_clis_json_...`)."""

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
