"""Fixtures shared by the proxy-trial modules."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from service.spec import ExperimentSpec, Plan
from service.train.run import ProxyResult


class SharedTrials:
    """Proxy results by (experiment, plan) for the whole session: test_proxy_3d and test_proxy_ray both
    train the tp2 plan on the same experiment, and each trial runs once."""

    def __init__(self) -> None:
        self._results: dict[tuple[str, str], ProxyResult] = {}

    def get(self, experiment: ExperimentSpec, plan: Plan, run: Callable[[], ProxyResult]) -> ProxyResult:
        key = (experiment.model_dump_json(), plan.model_dump_json())
        if key not in self._results:
            self._results[key] = run()
        return self._results[key]


@pytest.fixture(scope="session")
def shared_trials() -> SharedTrials:
    return SharedTrials()
