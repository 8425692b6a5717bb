"""Search service: Ray Tune searches parallel plans on proxy runs, pruned by the cost model, in MLflow.

`Search(experiment, space, config=SearchConfig(...), run_config=RunConfig(...)).fit() -> SearchResult`,
`Search.restore(path)`,
`SearchSpace` / `load_space` for the strict search-space schema, `SearchConfig` / `RunConfig` for settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.search.config import RunConfig, SearchConfig
from service.search.space import SearchSpace, load_space, space_from_dict

if TYPE_CHECKING:
    from service.search.driver import Search
    from service.search.result import SearchResult, TrialRecord

__all__ = [
    "RunConfig",
    "Search",
    "SearchConfig",
    "SearchResult",
    "SearchSpace",
    "TrialRecord",
    "load_space",
    "space_from_dict",
]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # Ray is imported only when the driver is used, so reading a space stays light.
    if name == "Search":
        from service.search.driver import Search

        return Search
    if name in ("SearchResult", "TrialRecord"):
        from service.search import result

        return getattr(result, name)
    raise AttributeError(f"module 'service.search' has no attribute {name!r}")
