"""Tracking: a narrow interface over MLflow that never loses a record when the store is down.

`Tracker` writes runs (parent and child), params, metrics, tags and artifacts; `resolve` decides the
store (MLFLOW_TRACKING_URI > experiment `tracking.uri` > `sqlite:///<repo>/mlflow.db`); `replay_pending`
writes records kept while the store was unreachable; `search_plots` draws the standard plots.
"""

from __future__ import annotations

from service.spec.tracking import TrackingSpec
from service.tracking.tracker import Tracker, tracker_for
from service.tracking.uri import TrackingTarget, default_uri, repo_root, resolve


def replay_pending(spec: TrackingSpec | None = None, experiment_name: str = "default") -> dict[str, object]:
    """Writes any records kept for the store `spec` resolves to; returns the tracker's status."""
    tracker = Tracker(resolve(spec or TrackingSpec(), experiment_name))
    return tracker.status()


def search_plots(rows, folder):  # type: ignore[no-untyped-def]
    """Lazy re-export: matplotlib is imported only when plots are drawn."""
    from service.tracking.plots import search_plots as _plots

    return _plots(rows, folder)


__all__ = [
    "Tracker",
    "TrackingSpec",
    "TrackingTarget",
    "default_uri",
    "replay_pending",
    "repo_root",
    "resolve",
    "search_plots",
    "tracker_for",
]
