"""Fixtures of the cluster tests: a throwaway PostgreSQL server (tests/cluster/local_postgres.py) for
MLflow's tracking store."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from local_postgres import LocalPostgres, bin_dir, local_postgres


@pytest.fixture(scope="module")
def postgres() -> Iterator[LocalPostgres]:
    """One server per module (about a second to start); each test gets a database of its own."""
    if bin_dir() is None:
        pytest.skip("PostgreSQL is not installed: no initdb on PATH or under /usr/lib/postgresql/*/bin "
                    "(CI setup: apt-get install -y postgresql)")  # fmt: skip
    with local_postgres() as server:
        yield server


@pytest.fixture
def postgres_uri(postgres: LocalPostgres) -> str:
    """A fresh, empty database on the module's server, as MLflow takes it (`postgresql+psycopg://`)."""
    name = f"t_{secrets.token_hex(4)}"
    postgres.create_database(name)
    return postgres.sqlalchemy_uri(name)
