"""Plans, proxies and searches parallel training plans for a large LLM run.

The public API, shaped like Ray's: config objects in, typed results out. Heavy parts (Ray, torch,
DeepSpeed) are imported only when their names are first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from service.spec import (
    Budget,
    ClusterSpec,
    ExperimentSpec,
    GPUSpec,
    ModelSpec,
    Plan,
    ProxySpec,
    SpecError,
    TrackingSpec,
    Workload,
    load_experiment,
)

# name -> module that defines it; imported on first use so `import service` stays light.
_LAZY: dict[str, str] = {
    "estimate": "service.costmodel",
    "estimate_table": "service.costmodel",
    "Estimate": "service.costmodel",
    "Planner": "service.planner",
    "PlanResult": "service.planner",
    "RankedPlan": "service.planner",
    "estimate_plan": "service.planner",
    "Run": "service.design",
    "RunResult": "service.design",
    "Search": "service.search",
    "SearchConfig": "service.search",
    "SearchResult": "service.search",
    "SearchSpace": "service.search",
}

if TYPE_CHECKING:  # what mypy sees for every lazy name (at run time they come from __getattr__)
    from service.costmodel import Estimate as Estimate
    from service.costmodel import estimate as estimate
    from service.costmodel import estimate_table as estimate_table
    from service.design import Run as Run
    from service.design import RunResult as RunResult
    from service.planner import Planner as Planner
    from service.planner import PlanResult as PlanResult
    from service.planner import RankedPlan as RankedPlan
    from service.planner import estimate_plan as estimate_plan
    from service.search import Search as Search
    from service.search import SearchConfig as SearchConfig
    from service.search import SearchResult as SearchResult
    from service.search import SearchSpace as SearchSpace

__all__ = [
    "Budget",
    "ClusterSpec",
    "ExperimentSpec",
    "GPUSpec",
    "ModelSpec",
    "Plan",
    "ProxySpec",
    "SpecError",
    "TrackingSpec",
    "Workload",
    "load_experiment",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'service' has no attribute {name!r}")
