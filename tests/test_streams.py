"""The two xdist streams of `bash .ci/test` (tests/conftest.py): every test file has one, the proxy
trials and the killed-driver search share one, and the `ray start` cluster tests share the other."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTS, stream_of


def test_every_test_file_is_in_one_of_two_streams() -> None:
    files = sorted(TESTS.rglob("test_*.py"))
    streams = {f: stream_of(f) for f in files}
    assert set(streams.values()) == {"trials", "rest"}
    trials = {f.relative_to(TESTS).as_posix() for f, s in streams.items() if s == "trials"}
    assert {"train/test_proxy_3d.py", "train/test_proxy_ray.py", "search/test_resume_driver.py"} <= trials
    assert all(f.startswith("train/") for f in trials - {"search/test_resume_driver.py"})
    # Both modules that share the session's tp2 trial (tests/train/conftest.py) run in one process.
    assert stream_of(TESTS / "train/test_proxy_3d.py") == stream_of(TESTS / "train/test_proxy_ray.py")
    cluster = [f for f in files if f.parent.name == "cluster"]
    assert cluster and {stream_of(f) for f in cluster} == {"rest"}


def test_a_path_outside_the_tests_folder_is_an_error() -> None:
    with pytest.raises(ValueError):
        stream_of(Path("/elsewhere/test_x.py"))


def test_xdist_keeps_each_stream_on_one_worker() -> None:
    """The markers are set before xdist reads them into the node ids (a hook ordered after xdist's
    leaves every test its own unit, and the proxy trials end up on both workers)."""
    args = ["-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider", "-m", "not slow"]
    files = [
        "tests/test_streams.py::test_every_test_file_is_in_one_of_two_streams",
        "tests/train/test_cpu_layout.py",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *args, *files],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (tests/[^:]+)::", out, flags=re.M)
    workers = {f: {w for w, g in ran if g == f} for _, f in ran}
    assert set(workers) == {"tests/test_streams.py", "tests/train/test_cpu_layout.py"}, out[-2000:]
    assert all(len(w) == 1 for w in workers.values()), workers
    assert workers["tests/test_streams.py"] != workers["tests/train/test_cpu_layout.py"], workers
