"""A throwaway PostgreSQL server for tests: `initdb` into a short temp dir, `postgres` listening on
127.0.0.1 only (a free port, its unix socket in that dir), one role with a random password (scram),
stopped with `pg_ctl stop` and removed however the test ends.

PostgreSQL refuses to run as root, so as root its commands run as the `postgres` user (`runuser`), and
the temp dir is that user's; as anyone else they run directly. Debian's `postgresql` package leaves
`initdb` and `pg_ctl` off PATH (in /usr/lib/postgresql/<version>/bin); both places are looked in.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.cluster.ports import free_port

ROLE = "mlflow"


@dataclass(frozen=True)
class LocalPostgres:
    host: str
    port: int
    user: str
    password: str
    temp_dir: Path

    def sqlalchemy_uri(self, database: str) -> str:
        """What MLflow takes (`--backend-store-uri`): SQLAlchemy's form, psycopg 3 as the driver."""
        return f"postgresql+psycopg://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    def libpq_uri(self, database: str) -> str:
        """What psycopg itself connects with."""
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> None:
        import psycopg

        # CREATE DATABASE cannot run inside a transaction, hence autocommit.
        with psycopg.connect(self.libpq_uri("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')


def bin_dir() -> Path | None:
    """The folder holding `initdb` and `pg_ctl`: on PATH, else the newest Debian install; None if absent."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    installed = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return installed[-1].parent if installed else None


def _server_user() -> str | None:
    """The user PostgreSQL runs as: None (ourselves) unless we are root, which initdb and postgres refuse."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):  # `postgres` comes with Debian's package; `nobody` is everywhere
        with suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and there is neither a postgres nor a nobody user to run PostgreSQL")


def _as(user: str | None, cmd: list[str]) -> list[str]:
    return ["runuser", "-u", user, "--", *cmd] if user else cmd


def _run(user: str | None, cmd: list[str], cwd: Path, timeout_s: float) -> None:
    proc = subprocess.run(_as(user, cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{Path(cmd[0]).name} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
        )


@contextmanager
def local_postgres(timeout_s: float = 60.0) -> Iterator[LocalPostgres]:
    """A running server for the block; raises FileNotFoundError where PostgreSQL is not installed."""
    bindir = bin_dir()
    if bindir is None:
        raise FileNotFoundError("no initdb on PATH or under /usr/lib/postgresql/*/bin")
    user = _server_user()
    # Short and under /tmp: the unix socket's path is limited to ~100 bytes, and pytest's tmp_path is
    # root's alone (0700), out of reach of the user the server runs as.
    temp_dir = Path(tempfile.mkdtemp(prefix="pg", dir="/tmp"))
    server = LocalPostgres("127.0.0.1", free_port(), ROLE, secrets.token_hex(16), temp_dir)
    try:
        _start(server, user, bindir, timeout_s)
        yield server
    finally:
        # Also after a failed start: `pg_ctl start -w` can give up while the server goes on starting.
        if (temp_dir / "data" / "postmaster.pid").exists():
            _stop(user, bindir, temp_dir / "data", temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _start(server: LocalPostgres, user: str | None, bindir: Path, timeout_s: float) -> None:
    data, log, pwfile = server.temp_dir / "data", server.temp_dir / "postgres.log", server.temp_dir / "pw"
    pwfile.write_text(server.password)
    if user:
        entry = pwd.getpwnam(user)
        for path in (server.temp_dir, pwfile):
            os.chown(path, entry.pw_uid, entry.pw_gid)
    try:
        # No locale (a machine's LANG may name one that is not generated); no fsync: a throwaway store.
        _run(user, [str(bindir / "initdb"), "-D", str(data), "-U", server.user, "--pwfile", str(pwfile),
                    "--auth=scram-sha-256", "--no-locale", "-E", "UTF8", "--no-sync"],
             server.temp_dir, timeout_s)  # fmt: skip
        pwfile.unlink()
        options = f"-h {server.host} -p {server.port} -k {server.temp_dir} -c fsync=off"
        _run(user, [str(bindir / "pg_ctl"), "start", "-D", str(data), "-l", str(log), "-o", options,
                    "-w", "-t", str(int(timeout_s))], server.temp_dir, timeout_s + 10)  # fmt: skip
    except RuntimeError as err:
        tail = log.read_text()[-3000:] if log.is_file() else ""
        raise RuntimeError(f"{err}\n{tail}") from None


def _stop(user: str | None, bindir: Path, data: Path, cwd: Path) -> None:
    """Fast shutdown (sessions closed, no waiting for clients); immediate if that does not finish."""
    pg_ctl = [str(bindir / "pg_ctl"), "stop", "-D", str(data), "-w", "-t", "30"]
    try:
        _run(user, [*pg_ctl, "-m", "fast"], cwd, 40)
    except (RuntimeError, subprocess.TimeoutExpired):
        _run(user, [*pg_ctl, "-m", "immediate"], cwd, 40)


def table_rows(sqlalchemy_uri: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows straight from PostgreSQL, past MLflow (psycopg takes the URI without SQLAlchemy's `+psycopg`)."""
    import psycopg

    with psycopg.connect(sqlalchemy_uri.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
        return conn.execute(sql, params).fetchall()
