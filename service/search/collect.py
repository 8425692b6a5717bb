"""Tune's results → one `TrialRecord` per trial, in the order the searcher launched them."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.search.prune import PruneResult
from service.search.result import TrialRecord, fallback_of, trial_outcome
from service.spec.record import Observation


def collect_trials(grid: Any, pr: PruneResult, steps: int, path: Path) -> list[TrialRecord]:
    """One `TrialRecord` per Tune trial of a plan in `pr`, from its reports (every step) and Tune's error,
    sorted in launch order (the searcher's log in `path`)."""
    by_key = {c.key: c for c in pr.candidates}
    trials = []
    for res in grid:
        key = (res.config or {}).get("plan")
        if key not in by_key:
            continue
        df = res.metrics_dataframe
        rows = [] if df is None else df.to_dict("records")
        rows = [{k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))} for r in rows]
        status, reason, step = trial_outcome(rows, res.error, steps)
        steps_seen = (r for r in reversed(rows) if "step" in r and "trial_status" not in r)
        last: dict[str, Any] = next(steps_seen, {})
        observed = Observation.from_report(last)  # Tune's reports: the Ray boundary
        trials.append(
            TrialRecord(
                trial_id=Path(res.path).name,
                key=key,
                plan=by_key[key].plan,
                status=status,
                reason=reason,
                steps=step,
                measured=observed.measured,
                predicted=observed.predicted or by_key[key].predicted,
                device_fallback=fallback_of(last),
                path=str(res.path),
                checkpoint_path=last_checkpoint(path, Path(res.path).name),
            )
        )
    return sorted(trials, key=launch_rank(path))


def last_checkpoint(path: Path, trial_id: str) -> str | None:
    """The newest checkpoint folder of the trial's Train run under the search's `proxy_runs`, if any."""
    from service.search.trial import train_run_name

    run_dir = path / "proxy_runs" / train_run_name(trial_id)
    found = sorted(run_dir.glob("checkpoint_*"), key=lambda p: p.stat().st_mtime) if run_dir.is_dir() else []
    return str(found[-1]) if found else None


def launch_rank(path: Path) -> Callable[[TrialRecord], int]:
    """Sort key: the order the searcher launched trials in (what a user expects to read)."""
    from service.search.tuning import LAUNCH_ORDER_FILE

    order_file = path / LAUNCH_ORDER_FILE
    lines = order_file.read_text().split("\n") if order_file.is_file() else []
    rank = {line.split()[0]: i for i, line in enumerate(lines) if line.strip()}
    return lambda t: rank.get(t.trial_id, len(rank))
