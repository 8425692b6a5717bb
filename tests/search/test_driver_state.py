"""`Search` without Ray: arguments and defaults, the saved state and `Search.restore` from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.search.config import RunConfig, SearchConfig
from service.search.driver import STATE_FILE, Search
from service.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
EXPERIMENT = REPO / "experiments" / "tiny-cpu.yaml"
SPACE = REPO / "search_spaces" / "tiny-cpu.yaml"
RANDOM_2 = SearchConfig(algorithm="random", max_trials=2)


def test_arguments_override_the_space_defaults(tmp_path: Path) -> None:
    search = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path))
    assert (search.algorithm, search.max_trials, search.patience, search.steps) == ("grid", 3, 2, 5)
    search = Search(
        EXPERIMENT,
        SPACE,
        config=SearchConfig(algorithm="bayes", max_trials=5, patience=1),
        run_config=RunConfig(storage_path=tmp_path, name="s"),
    )
    assert (search.algorithm, search.max_trials, search.patience) == ("bayes", 5, 1)
    assert search.path == tmp_path.resolve() / "s"


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"algorithm": "anneal"}, "algorithm"), ({"max_trials": 0}, "max_trials")]
)
def test_bad_arguments_are_spec_errors(kwargs: dict, field: str, tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        Search(EXPERIMENT, SPACE, config=SearchConfig(**kwargs), run_config=RunConfig(storage_path=tmp_path))
    assert info.value.field == field


def test_state_round_trip(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    run_config = RunConfig(storage_path=tmp_path, name="s1")
    search = Search(EXPERIMENT, SPACE, config=RANDOM_2, run_config=run_config)
    search.path.mkdir(parents=True)
    (search.path / STATE_FILE).write_text(json.dumps(search._state()))
    monkeypatch.setenv(
        "MLFLOW_TRACKING_URI", "http://127.0.0.1:1"
    )  # a restore keeps the store it started with
    again = Search.restore(search.path)
    assert again._restored and again.name == "s1" and again.storage_path == search.storage_path
    assert (again.algorithm, again.max_trials, again.steps, again.guided) == ("random", 2, 5, True)
    assert again.experiment == search.experiment and again.space == search.space
    assert again.target == search.target and again.target.uri.endswith("/m.db")
    assert [c.key for c in again.pruning().candidates] == [c.key for c in search.pruning().candidates]
    assert [(p.kind, p.reason) for p in again.pruning().pruned] == [
        (p.kind, p.reason) for p in search.pruning().pruned
    ]


def test_restore_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is not a search folder"):
        Search.restore(tmp_path)
    (tmp_path / STATE_FILE).write_text('{"experiment": {"name": 3}}')
    with pytest.raises(SpecError, match="is not a valid search state") as info:
        Search.restore(tmp_path)
    assert "\n" not in str(info.value)


def test_a_search_whose_tune_state_was_cut_off_is_not_continued(tmp_path: Path, monkeypatch) -> None:
    """Tune writes experiment_state-*.json in place; a driver killed during the write leaves it empty.
    Continuing would restore no trial while the searcher remembers its launches, so the search says so
    in one line instead (and `run` starts a fresh one: tests/design)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    run_config = RunConfig(storage_path=tmp_path, name="s2")
    search = Search(EXPERIMENT, SPACE, config=RANDOM_2, run_config=run_config)
    search.path.mkdir(parents=True)
    (search.path / STATE_FILE).write_text(json.dumps(search._state()))
    assert Search.can_restore(search.path)  # the driver died before Tune saved anything
    (search.path / "experiment_state-2026-12-03_19-54-44.json").write_text('{"trial_data": [')
    assert not Search.can_restore(search.path)
    with pytest.raises(SpecError, match=r"experiment_state-2026-12-03_19-54-44\.json .* was cut off") as info:
        Search.restore(search.path)
    assert "\n" not in str(info.value)
    (search.path / "experiment_state-2026-12-03_19-54-44.json").write_text('{"trial_data": []}')
    assert Search.can_restore(search.path) and Search.restore(search.path)._restored


def test_concurrency_is_capped_by_resources_and_world_size(monkeypatch) -> None:
    import ray

    from service.search.tuning import max_concurrent_trials

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 9.0, "GPU": 16.0})
    assert max_concurrent_trials(2, "cpu") == 4  # one CPU is kept for the trial drivers
    assert max_concurrent_trials(8, "cuda") == 2
    assert max_concurrent_trials(3, "cuda") == 5
    with pytest.raises(SpecError, match="a trial needs 32 GPUs but the Ray cluster offers 16"):
        max_concurrent_trials(32, "cuda")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(SpecError, match="needs 2 CPUs"):
        max_concurrent_trials(2, "cpu")


def test_collect_keeps_the_workers_device_fallback(tmp_path: Path) -> None:
    """A worker on a GPU resource without CUDA reports `device_fallback` (a string among its floats);
    the trial's record keeps it, so a search's JSON says its numbers are CPU numbers."""
    from types import SimpleNamespace

    import pandas as pd

    search = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path, name="s"))
    first, second = search.pruning().candidates[:2]
    step = {"step": 5.0, "tokens_per_s": 900.0, "loss": 6.0}
    fell_back = {**step, "device_fallback": "GPU resource without a CUDA device: ran on CPU/gloo"}
    final = {"trial_status": "ok", "trial_reason": "", "done": 1.0}

    def trial(trial_id: str, key: str, rows: list[dict]) -> SimpleNamespace:
        frame = pd.DataFrame(rows)  # Tune's table: NaN where a row lacks a column
        return SimpleNamespace(
            config={"plan": key}, metrics_dataframe=frame, error=None, path=f"/x/{trial_id}"
        )

    grid = [trial("t1", first.key, [fell_back, final]), trial("t2", second.key, [step, final])]
    records = {t.trial_id: t for t in search._collect(grid, search.pruning()).trials}
    assert records["t1"].device_fallback == fell_back["device_fallback"]
    assert records["t1"].status == "ok" and records["t1"].measured.tokens_per_s == 900.0
    assert records["t2"].device_fallback == ""  # ran where it asked
    assert records["t1"].to_dict()["device_fallback"] == fell_back["device_fallback"]


def test_a_space_written_for_another_experiment_is_refused(tmp_path):
    """search_spaces/llama2-13b-32xh100.yaml says which experiment it is for; with tiny-cpu it is refused
    in one line naming the field, before anything is written."""
    seed_space = REPO / "search_spaces" / "llama2-13b-32xh100.yaml"
    with pytest.raises(SpecError, match=r"experiment: the search space 'llama2-13b-32xh100' was written for"):
        Search(EXPERIMENT, seed_space, run_config=RunConfig(storage_path=tmp_path))
    assert not any(tmp_path.iterdir())
    Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path))  # its own space: accepted


def test_load_params_refuses_a_non_path_with_a_spec_error():
    from service.spec.params import load_params

    with pytest.raises(SpecError, match="params"):
        load_params(5)  # type: ignore[arg-type]


def test_a_second_search_under_a_used_name_is_refused_before_it_runs(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    first = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path, name="same"))
    first.path.mkdir(parents=True)
    (first.path / STATE_FILE).write_text(json.dumps(first._state()))
    again = Search(
        EXPERIMENT, SPACE, config=RANDOM_2, run_config=RunConfig(storage_path=tmp_path, name="same")
    )
    with pytest.raises(SpecError, match="a search named 'same' is already in") as info:
        again.fit()
    assert info.value.field == "name"
    assert json.loads((first.path / STATE_FILE).read_text()) == first._state()  # the first one kept
    assert Search.restore(first.path)._restored  # and it can still be continued


def test_a_saved_search_restores_with_the_rules_it_was_saved_with(tmp_path: Path, monkeypatch) -> None:
    """A rule the space checks refuse today (one on a field not searched) was saved by an older search:
    that search still continues."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    search = Search(EXPERIMENT, SPACE, run_config=RunConfig(storage_path=tmp_path, name="old"))
    search.path.mkdir(parents=True)
    state = search._state()
    state["space"]["constraints"]["exclude"] = [{"pp": 2}]
    (search.path / STATE_FILE).write_text(json.dumps(state))
    assert Search.restore(search.path).space.constraints.exclude[0].pp == 2
