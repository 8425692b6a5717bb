"""A search's saved state: the file `Search.restore` continues from, and whether Tune's own state beside
it can be continued."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError

STATE_FILE = "search_state.json"


def tune_state_problem(folder: Path) -> str | None:
    """Why Tune cannot continue the search saved in `folder`, or None (also when Tune never saved one:
    the driver died before its Tuner started, and the search starts its Tuner afresh).

    Ray Tune writes `experiment_state-*.json` in place (`TuneController.save_to_dir`: open "w", then
    json.dump), so a driver killed during that write leaves it empty or cut off. `Tuner.restore` then
    restores no trial while the searcher's own state (written next) says which plans it launched: the
    continued search re-ran one plan and never ran another (seen once, a run killed as its first proxy
    finished). Such a search is not continued."""
    states = sorted(folder.glob("experiment_state-*.json"))
    if not states:
        return None
    newest = states[-1]
    try:
        json.loads(newest.read_text())
    except (OSError, ValueError):
        return (
            f"Tune's state {newest.name} in {folder} was cut off when its driver was killed; "
            "start the search again"
        )
    return None


def unfinished_trials(folder: Path) -> dict[str, str]:
    """Trial → Tune status, for the trials Tune's newest saved state in `folder` has running, pending or
    paused. Tune saves it one last time when its loop ends and only then stops what still runs (marking it
    TERMINATED in memory, with no trial callback): after a finished search every trial there is
    TERMINATED or ERROR; after a Ctrl-C the ones that were running (or waiting to start) are not."""
    states = sorted(folder.glob("experiment_state-*.json"))
    if not states:
        return {}
    try:
        data = json.loads(states[-1].read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for entry in data.get("trial_data", []):
        trial = entry[0] if isinstance(entry, list) else entry
        trial = json.loads(trial) if isinstance(trial, str) else trial
        if isinstance(trial, dict) and trial.get("status") in ("RUNNING", "PENDING", "PAUSED"):
            out[str(trial.get("relative_logdir") or trial.get("trial_id"))] = str(trial["status"])
    return out


def invalid_state(folder: Path, why: str) -> SpecError:
    """The one-line error for a state file that is there but cannot be read as a search."""
    return SpecError("resume", f"{folder / STATE_FILE} is not a valid search state: {why}")


def read_state(folder: Path) -> dict[str, Any]:
    """The saved state of the search in `folder`; a one-line `SpecError` (field `resume`) when there is
    none, when Tune's state was cut off, or when the file is not JSON."""
    if not (folder / STATE_FILE).is_file():
        raise SpecError("resume", f"{folder} is not a search folder (no {STATE_FILE})")
    cut = tune_state_problem(folder)
    if cut:
        raise SpecError("resume", cut)
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except ValueError as err:
        raise invalid_state(folder, str(err)) from None
    if not isinstance(state, dict):
        raise invalid_state(folder, "not a mapping")
    return state
