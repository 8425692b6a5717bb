"""The two xdist streams of `bash .ci/test` (tests/conftest.py): every test file has one, the proxy
trials and the hung-trial search share one, and the `ray start` cluster tests share the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TESTS, stream_of


def test_every_test_file_is_in_one_of_two_streams() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    streams = {f: stream_of(f) for f in files}
    assert set(streams.values()) == {"trials", "rest"}
    trials = {f.relative_to(TESTS).as_posix() for f, s in streams.items() if s == "trials"}
    assert {"train/test_proxy_3d.py", "train/test_proxy_ray.py"} <= trials
    # Besides the proxy trials: modules that start no `ray start` head, moved to even out the two streams
    outside = {f for f in trials if not f.startswith("train/")}
    whole = {f for f in outside if f.startswith(("report/", "profile/", "tracking/"))}
    assert outside - whole == {
        "search/test_hang_trial.py",
        "preflight/test_preflight_ray.py",
        "preflight/test_verdict.py",
        "preflight/test_first_hour.py",
        "cli/test_search.py",
        "calibrate/test_crossval.py",
        "plans/test_enumerate.py",
        "plans/test_enumeration_benchmark.py",
        "design/test_run_select.py",
        "design/test_moe_run.py",
    }
    assert whole == {
        f.relative_to(TESTS).as_posix()
        for d in ("report", "profile", "tracking")
        for f in (TESTS / d).glob("test_*.py")
    }
    # Both modules that share the session's tp2 trial (tests/train/conftest.py) run in one process.
    assert stream_of(TESTS / "train/test_proxy_3d.py") == stream_of(TESTS / "train/test_proxy_ray.py")
    cluster = [f for f in files if f.parent.name == "cluster"]
    assert cluster and {stream_of(f) for f in cluster} == {"rest"}


def test_a_path_outside_the_tests_folder_is_an_error() -> None:
    with pytest.raises(ValueError):
        stream_of(Path("/elsewhere/test_x.py"))
