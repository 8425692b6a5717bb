"""`Run`: the main job — plan, validate on proxies, calibrate, select, and write the memo.

`Run(experiment, ...).fit() -> RunResult`; see service/design/job.py for its steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.report.result import RunResult

if TYPE_CHECKING:  # what mypy sees; at run time `Run` comes from __getattr__
    from service.design.job import Run as Run

__all__ = ["Run", "RunResult"]


def __getattr__(name: str) -> Any:
    # Ray and the search are imported only when a run is made.
    if name == "Run":
        from service.design.job import Run

        return Run
    raise AttributeError(f"module 'service.design' has no attribute {name!r}")
