"""Fixtures shared by the proxy-trial modules."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from service.spec import ExperimentSpec, Plan
from service.train.proxy_trial import Launch, ProxyResult, run_proxy


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

    def trial(
        self,
        experiment: ExperimentSpec,
        plan: Plan,
        storage: str,
        name: str,
        steps: int,
        launch: Launch | None,
    ) -> ProxyResult:
        """`run_proxy` of `plan` for `steps` steps under `storage/name`, once per (experiment, plan):
        by `launch` (local_workers.launch), or under Ray Train when it is None."""
        return self.get(
            experiment,
            plan,
            lambda: run_proxy(
                experiment, plan, steps=steps, storage_path=storage, run_name=name, launch=launch
            ),
        )


@pytest.fixture(scope="session")
def shared_trials() -> SharedTrials:
    return SharedTrials()
