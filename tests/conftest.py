"""How `bash .ci/test` splits the suite over two pytest-xdist workers (`-n 2 --dist loadgroup`).

The suite is mostly proxy trials: real Ray and DeepSpeed worker processes, each spending seconds of
CPU on imports, and tests that wait on purpose (pending and hang timeouts, a killed driver, a store
that is down, autoscaled fake nodes). Run one after another they leave the two cores idle for about a
third of the time; as two streams side by side the cores stay ~90 % busy, and the suite takes about
0.8 of its serial time on a fresh clone.

Each test goes to one of two fixed groups (xdist's `xdist_group` marker), so the split is the same on
every run and each stream runs its tests in file order:
- "trials": tests/train (the proxy trials, and the session fixture two of its modules share), the
  hung-trial search test, preflight, the search CLI's one-line errors, the heaviest pure-computation
  modules (the cross-validation, plan enumeration and its benchmark), and, to even out the two, the
  report, profile and tracking modules and `run`'s selection and MoE modules: about half the suite's
  test time, measured with `--durations=0` on a fresh clone;
- "rest": everything else. The cluster tests that start `ray start` heads stay in one stream.

Without `-n` (a plain `python -m pytest ...`) the markers do nothing and the tests run serially.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TRIALS = (
    "train/",
    "search/test_hang_trial.py",
    "preflight/",
    "cli/test_search.py",
    "calibrate/test_crossval.py",
    "plans/test_enumerate.py",
    "plans/test_enumeration_benchmark.py",
    "report/",
    "profile/",
    "tracking/",
    "design/test_run_select.py",
    "design/test_moe_run.py",
)


def stream_of(path: Path) -> str:
    """The xdist group of a test file: "trials" or "rest"."""
    relative = path.resolve().relative_to(TESTS).as_posix()
    return "trials" if relative.startswith(TRIALS) else "rest"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marker into the node id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(stream_of(item.path)))


@pytest.fixture(scope="module", autouse=True)
def _no_ray_left_up() -> Iterator[None]:
    """Each module leaves no Ray session behind in this process: a later test's `ensure_ray` would
    connect to it, with whatever actors and placement groups were left in it holding its CPUs, instead
    of starting its own (module-scoped Ray fixtures tear down before this one)."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
