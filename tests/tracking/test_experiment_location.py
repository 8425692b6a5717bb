"""A new MLflow experiment's artifact folder stays under the artifact root whatever its name: MLflow
takes any name ("/Users/me/exp" on Databricks), and a name joined to the root as it is could climb out
of it ("../../x")."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.spec import SpecError
from service.spec.tracking import TrackingSpec
from service.tracking.uri import TrackingTarget, resolve

ROOT = "file:///srv/mlartifacts"


def _target(root: str | None = ROOT) -> TrackingTarget:
    return TrackingTarget("sqlite:////srv/mlflow.db", "x", root, Path("/tmp/pending"))


@pytest.mark.parametrize("name", ["../../escaped", "/Users/me@x.com/llama", "a/b", ".hidden", "x" * 300])
def test_a_name_that_is_no_plain_folder_gets_a_folder_of_its_own_under_the_root(name: str) -> None:
    location = _target().experiment_location(name)
    assert location is not None and location.startswith(ROOT + "/")
    folder = location[len(ROOT) + 1 :]
    assert "/" not in folder and ".." not in folder and not folder.startswith(".") and len(folder) <= 73
    assert _target().experiment_location(name + "2") != location  # distinct names, distinct folders


def test_a_plain_name_is_its_own_folder_and_no_root_is_the_servers_default() -> None:
    assert _target().experiment_location("llama2-13b-32xh100") == f"{ROOT}/llama2-13b-32xh100"
    assert _target(None).experiment_location("../../escaped") is None


def test_the_spec_takes_any_name_but_an_empty_one(tmp_path: Path) -> None:
    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_name="../../escaped")
    target = resolve(spec, "default")
    location = target.experiment_location(target.experiment_name)
    assert location is not None and location.startswith((tmp_path / "mlartifacts").as_uri() + "/")
    with pytest.raises((SpecError, ValueError)):
        TrackingSpec(experiment_name="  ")


@pytest.mark.parametrize(
    ("env", "uri", "field"),
    [("foo://user:secret@bar", None, "MLFLOW_TRACKING_URI"), (None, "mlfow://typo", "tracking.uri")],
)
def test_a_uri_of_no_store_mlflow_knows_is_refused_naming_where_it_came_from(monkeypatch, env, uri, field):
    from service.spec import TrackingSpec
    from service.spec.errors import SpecError
    from service.tracking.uri import resolve

    if env:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SpecError, match="is no MLflow tracking store's scheme") as err:
        resolve(TrackingSpec(uri=uri), "e")
    assert err.value.field == field and "secret" not in str(err.value)
    for good in (
        "postgresql+psycopg://u@h/db",
        "http://127.0.0.1:5000",
        "sqlite:////tmp/x.db",
        "/tmp/mlruns",
    ):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", good)
        assert resolve(TrackingSpec(), "e").uri == good


def test_a_tracking_store_plugins_scheme_is_taken(monkeypatch):
    from service.spec import TrackingSpec
    from service.tracking import uri

    monkeypatch.setattr(uri, "_plugin_schemes", lambda: {"azureml"})  # as azureml-mlflow registers it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "azureml://eastus.api.azureml.ms/mlflow/v1.0/ws")
    assert uri.resolve(TrackingSpec(), "e").uri.startswith("azureml://")
