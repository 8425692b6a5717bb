"""`python -m service mlflow-server --backend-store-uri`: a plain PostgreSQL URI gets psycopg (3) as its
driver (SQLAlchemy would pick psycopg2, which is not installed); a driver that is not installed fails in
one line naming the flag, before any server starts; a password in the URI is masked when printed."""

from __future__ import annotations

import pytest

from service.cli.main import main
from service.cli.mlflow_server import check_driver, shown, store_uri
from service.spec.errors import SpecError


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("postgresql://mlflow@10.0.0.5:5432/mlflow", "postgresql+psycopg://mlflow@10.0.0.5:5432/mlflow"),
        ("postgres://mlflow:pw@db/mlflow", "postgresql+psycopg://mlflow:pw@db/mlflow"),
        ("postgresql+psycopg://mlflow@db/mlflow", "postgresql+psycopg://mlflow@db/mlflow"),
        ("postgresql+psycopg2://mlflow@db/mlflow", "postgresql+psycopg2://mlflow@db/mlflow"),
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
        ("mysql://mlflow@db/mlflow", "mysql://mlflow@db/mlflow"),
    ],
)
def test_a_plain_postgresql_uri_gets_psycopg_and_others_are_kept(given: str, used: str) -> None:
    assert store_uri(given) == used


def test_the_installed_driver_passes() -> None:
    check_driver("postgresql+psycopg://mlflow@db/mlflow")  # psycopg is in the dev extras
    check_driver("sqlite:////tmp/mlflow.db")  # not PostgreSQL: nothing to check


def test_a_missing_psycopg_is_one_line_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "psycopg" else real(name))
    with pytest.raises(SpecError) as err:
        check_driver(store_uri("postgresql://mlflow@db/mlflow"))
    assert str(err.value) == (
        "--backend-store-uri: PostgreSQL through psycopg needs its package: pip install 'psycopg[binary]'"
    )


def test_the_cli_refuses_a_missing_driver_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    uri = "postgresql+nosuchdriver://mlflow@127.0.0.1:1/mlflow"
    assert main(["mlflow-server", "--backend-store-uri", uri]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("error: --backend-store-uri: PostgreSQL through nosuchdriver needs its package")


def test_a_password_is_masked_when_printed() -> None:
    assert shown("postgresql+psycopg://mlflow:s3cret@db:5432/mlflow") == (
        "postgresql+psycopg://mlflow:***@db:5432/mlflow"
    )
    assert shown("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert shown("./mlruns") == "./mlruns"  # a file store: not a URL, shown as given
