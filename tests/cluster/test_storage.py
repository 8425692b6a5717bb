"""Where outputs go (service/cluster/storage.py): $SERVICE_STORAGE_PATH as a shared folder or a URI, and
`run` writing its memo there instead of into the repository (a job's vanishing working-dir copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.cluster import storage
from service.spec.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
REPO_RESULTS = Path("/repo/ray_results")


def tiny_experiment(tmp: Path, name: str) -> Path:
    data = yaml.safe_load((REPO / "experiments" / "tiny-cpu.yaml").read_text())
    data["name"] = name
    data["tracking"] = {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment_name": name}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_unset_or_empty_storage_keeps_outputs_under_the_repository(monkeypatch):
    monkeypatch.delenv(storage.STORAGE_ENV, raising=False)
    assert storage.results_root(REPO_RESULTS) == REPO_RESULTS and storage.remote_root() is None
    monkeypatch.setenv(storage.STORAGE_ENV, "  ")
    assert storage.results_root(REPO_RESULTS) == REPO_RESULTS


def test_a_folder_or_a_file_uri_is_written_directly(monkeypatch, tmp_path):
    monkeypatch.setenv(storage.STORAGE_ENV, str(tmp_path / "shared"))
    assert storage.results_root(REPO_RESULTS) == tmp_path / "shared" and storage.remote_root() is None
    monkeypatch.setenv(storage.STORAGE_ENV, f"file://{tmp_path}/shared")
    assert storage.results_root(REPO_RESULTS) == tmp_path / "shared" and storage.remote_root() is None


def test_a_remote_uri_is_staged_locally_and_named_for_the_copy(monkeypatch):
    monkeypatch.setenv(storage.STORAGE_ENV, "s3://lab-bucket/ray_results/")
    assert storage.results_root(REPO_RESULTS) == REPO_RESULTS
    assert storage.remote_root() == "s3://lab-bucket/ray_results"


@pytest.mark.parametrize(
    ("value", "words"),
    [("ray_results", "is relative"), ("ftp://host/x", "scheme ftp:// is not one pyarrow reads")],
)
def test_bad_storage_is_one_line_naming_the_variable(monkeypatch, value, words):
    monkeypatch.setenv(storage.STORAGE_ENV, value)
    with pytest.raises(SpecError) as err:
        storage.results_root(REPO_RESULTS)
    assert err.value.field == storage.STORAGE_ENV and words in str(err.value) and "\n" not in str(err.value)


def test_publish_copies_the_folder_tree_to_the_uri(tmp_path):
    local = tmp_path / "out"
    (local / "charts").mkdir(parents=True)
    (local / "memo.md").write_text("# memo\n")
    (local / "charts" / "a.png").write_bytes(b"\x89PNG")
    destination = storage.publish(local, "run", "seed", root=f"file://{tmp_path}/remote/")
    assert destination == f"file://{tmp_path}/remote/run/seed"
    copied = tmp_path / "remote" / "run" / "seed"
    assert (copied / "memo.md").read_text() == "# memo\n" and (
        copied / "charts" / "a.png"
    ).read_bytes() == b"\x89PNG"
    assert storage.publish(local, "run", "seed", root=None) is None  # nothing remote configured


def test_run_writes_its_memo_under_the_storage_path(monkeypatch, tmp_path):
    from service import Run

    monkeypatch.setenv(storage.STORAGE_ENV, str(tmp_path / "shared"))
    result = Run(tiny_experiment(tmp_path, "stored"), run_proxies=False).fit()
    out = tmp_path / "shared" / "run" / "stored"
    assert Path(result.out_dir) == out and result.copied_to is None
    assert Path(result.memo_paths["html"]).parent == out and (out / "memo.html").is_file()
    assert Path(result.ds_config_path or "").is_file() and (out / "launch.sh").is_file()


def test_run_copies_its_folder_to_a_remote_storage_uri(monkeypatch, tmp_path):
    from service import Run

    # A remote store stands in as a file:// URI (pyarrow's copy is the same for s3:// or gs://).
    monkeypatch.setattr(storage, "remote_root", lambda: f"file://{tmp_path}/bucket")
    result = Run(
        tiny_experiment(tmp_path, "copied"), storage_path=tmp_path / "staging", run_proxies=False
    ).fit()
    assert result.copied_to == f"file://{tmp_path}/bucket/run/staging"
    copied = tmp_path / "bucket" / "run" / "staging"
    for name in ("memo.html", "memo.md", "ds_config.json", "launch.sh", "result.json"):
        assert (copied / name).read_bytes() == (tmp_path / "staging" / name).read_bytes(), name


def test_train_refuses_a_uri_it_cannot_checkpoint_to(monkeypatch):
    from service.train.production import ProductionRun

    monkeypatch.setenv(storage.STORAGE_ENV, "s3://lab-bucket/ray_results")
    with pytest.raises(SpecError) as err:
        ProductionRun(
            "experiments/llama2-13b-32xh100.yaml", "dp16-tp2-pp1-z1-mb2-ga4-rc:none-sp", track=False
        )
    assert err.value.field == storage.STORAGE_ENV and "mount it" in str(err.value)


def test_the_mlflow_hint_for_a_server_is_its_url_not_mlflow_ui():
    from service.tracking.uri import ui_hint

    assert ui_hint("http://10.0.0.5:5000/") == (
        "open http://10.0.0.5:5000 (the MLflow server's UI; on a cluster, tunnel to the head first)"
    )
    assert ui_hint("sqlite:////repo/mlflow.db").startswith(
        "mlflow ui --backend-store-uri sqlite:////repo/mlflow.db"
    )
