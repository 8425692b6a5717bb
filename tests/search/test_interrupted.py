"""A search stopped by Ctrl-C (Tune returns from it as from a finished search): the trial that was running
is `interrupted`, not failed; the search says so, its MLflow runs end KILLED and the CLI exits 130."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd

from service.search import recording
from service.search.config import RunConfig
from service.search.driver import Search
from service.search.state import unfinished_trials

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = REPO / "experiments" / "tiny-cpu.yaml"
SPACE = REPO / "search_spaces" / "tiny-cpu.yaml"


def tune_state(folder: Path, statuses: dict[str, str]) -> None:
    """Tune's experiment state as TuneController.save_to_dir writes it: (trial JSON, runtime) pairs."""
    trials = [
        [json.dumps({"trial_id": t, "relative_logdir": t, "status": s}), "{}"] for t, s in statuses.items()
    ]
    (folder / "experiment_state-2026-12-07_11-07-44.json").write_text(json.dumps({"trial_data": trials}))


def test_unfinished_trials_are_those_tune_saved_running_pending_or_paused(tmp_path: Path) -> None:
    assert unfinished_trials(tmp_path) == {}  # no state: nothing ran
    tune_state(tmp_path, {"a": "TERMINATED", "b": "RUNNING", "c": "ERROR", "d": "PENDING", "e": "PAUSED"})
    assert unfinished_trials(tmp_path) == {"b": "RUNNING", "d": "PENDING", "e": "PAUSED"}


def _grid(search: Search, done: str, running: str) -> list[SimpleNamespace]:
    first, second = (c.key for c in search.pruning().candidates[:2])
    steps = pd.DataFrame(
        [{"step": float(s), "tokens_per_s": 1000.0, "last_step": float(s == 5)} for s in range(1, 6)]
    )
    return [
        SimpleNamespace(
            config={"plan": first}, metrics_dataframe=steps, error=None, path=str(search.path / done)
        ),
        SimpleNamespace(
            config={"plan": second}, metrics_dataframe=None, error=None, path=str(search.path / running)
        ),
    ]


def test_the_running_trial_is_interrupted_and_the_search_says_how_to_go_on(tmp_path: Path) -> None:
    search = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path, name="s"))
    search.path.mkdir(parents=True)
    grid = _grid(search, "t1", "t2")
    tune_state(search.path, {"t1": "TERMINATED", "t2": "RUNNING"})
    result = search._collect(grid, search.pruning())
    assert [t.status for t in result.trials] == ["ok", "interrupted"] and result.interrupted
    assert result.stopped_reason.startswith("interrupted:") and "--resume" in result.stopped_reason
    assert result.best is not None and result.best.trial_id == "t1"
    tune_state(search.path, {"t1": "TERMINATED", "t2": "PENDING"})  # t2 still waited for its workers
    waiting = search._collect(grid, search.pruning())
    assert [t.trial_id for t in waiting.trials] == ["t1"] and waiting.stopped_reason.startswith("interrupted")
    tune_state(search.path, {"t1": "TERMINATED", "t2": "TERMINATED"})  # the same search, finished
    finished = search._collect(grid, search.pruning())
    assert not finished.interrupted and finished.trials[1].status == "failed"  # no report: it never ran


class Tracker:
    def __init__(self) -> None:
        self.ended: dict[str, str] = {}
        self.tags: dict[str, dict[str, str]] = {}

    def log_batch(self, key: str, params=None, metrics=None, tags=None, step=None) -> None:
        self.tags.setdefault(key, {}).update(tags or {})

    def end_run(self, key: str, status: str) -> None:
        self.ended[key] = status

    def log_text(self, *args) -> None: ...

    def log_artifact(self, *args) -> None: ...


def test_an_interrupted_search_ends_its_runs_killed(tmp_path: Path, monkeypatch) -> None:
    search = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path, name="s"))
    search.path.mkdir(parents=True)
    tune_state(search.path, {"t1": "TERMINATED", "t2": "RUNNING"})
    result = search._collect(_grid(search, "t1", "t2"), search.pruning())
    tracker = Tracker()
    monkeypatch.setattr(recording, "tracker_for", lambda target: tracker)
    recording.finish_search(search.target, "s", result)
    assert tracker.ended == {recording.trial_key("s", "t2"): "KILLED", recording.parent_key("s"): "KILLED"}
    assert tracker.tags[recording.trial_key("s", "t2")]["trial_status"] == "interrupted"
    assert tracker.tags[recording.parent_key("s")]["search_status"] == "interrupted"


def test_the_cli_exits_130_when_the_search_was_stopped(monkeypatch, capsys, tmp_path: Path) -> None:
    import service.cli.search as cli
    from service.cli.main import main

    search = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path, name="s"))
    search.path.mkdir(parents=True)
    tune_state(search.path, {"t1": "TERMINATED", "t2": "RUNNING"})
    result = search._collect(_grid(search, "t1", "t2"), search.pruning())
    monkeypatch.setattr(cli, "_make_search", lambda args: SimpleNamespace(fit=lambda: result))
    assert main(["search", str(EXPERIMENT), "--space", str(SPACE), "--json"]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out)["stopped_reason"].startswith("interrupted")  # still one JSON document
    assert err.strip().splitlines()[-1].startswith("error: interrupted: `python -m service search --resume")
