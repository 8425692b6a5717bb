"""Output paths stay where the user said (issue #35): a name cannot leave the storage root, and a `--out`
whose folder does not exist is refused in one line instead of created."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.cli.main import main
from service.design.job import default_out_dir
from service.spec import SpecError, load_experiment

TINY = Path(__file__).resolve().parents[2] / "experiments" / "tiny-cpu.yaml"


def _named(tmp_path: Path, name: str) -> Path:
    data = yaml.safe_load(TINY.read_text())
    data["name"] = name
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_name_that_leaves_the_run_folder_is_refused(tmp_path, capsys):
    escaped = tmp_path / "x" / "escaped"
    name = "../" * 12 + str(escaped).lstrip("/")
    assert main(["run", str(_named(tmp_path, name)), "--no-proxies", "--json"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "exp.yaml: name: " in err and "plain folder name" in err
    assert not (tmp_path / "x").exists()


def test_default_out_dir_refuses_what_the_spec_was_not_asked_to_check():
    spec = load_experiment(TINY)
    assert default_out_dir(spec).name == "tiny-cpu"
    with pytest.raises(SpecError, match="would leave"):
        default_out_dir(spec.model_construct(**{**dict(spec), "name": "../../escaped"}))


@pytest.mark.parametrize(
    "argv",
    [
        ["run", str(TINY), "--no-proxies", "--out", "{tmp}/missing/run"],
        ["run", str(TINY), "--no-proxies", "--out", "{tmp}/a-file"],
        ["report", "{tmp}", "--out", "{tmp}/missing/memo"],
        ["calibrate", "{tmp}/runs.yaml", "--out", "{tmp}/missing/p.yaml"],
        ["calibrate", "{tmp}/runs.yaml", "--out", "{tmp}"],
    ],
)
def test_out_is_checked_before_any_work_and_nothing_is_created(tmp_path, capsys, argv):
    (tmp_path / "a-file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: --out: ")
    assert sorted(tmp_path.rglob("*")) == before


def test_an_experiment_path_that_is_no_path_is_a_spec_error():
    for bad in (None, 123, {"name": "x"}):
        with pytest.raises(SpecError, match="expected a file path"):
            load_experiment(bad)  # type: ignore[arg-type]


def test_proxies_asked_for_and_refused_at_once_is_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(TINY), "--no-proxies", "--max-proxies", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --max-proxies: 3 proxies and --no-proxies: give one of them"
    assert not out.exists()
