"""`python -m service mlflow-server [--host 127.0.0.1] [--port 5000] [--backend-store-uri URI]
[--artifacts-destination URI] [--no-serve-artifacts] [--no-restart]`

Runs MLflow's tracking server for drivers on this machine (on a cluster: the head) and for the UI
through a tunnel. The store is sqlite under the repo unless told; for a store shared by several heads,
PostgreSQL: `postgresql://USER@HOST:5432/DB`, read as `postgresql+psycopg://...` (psycopg 3, the dev
extras' driver; MLflow's default for a plain `postgresql://` would be psycopg2). The password is best
left to libpq (PGPASSWORD or ~/.pgpass) rather than written in the URI, where `ps` shows it; a password
in the URI is masked in what this command prints. Artifacts are proxied by the server
(`mlflow-artifacts:/`), so a client needs the server's URL and nothing else. It binds 127.0.0.1 unless
given a private address; it refuses to listen on every interface. Prints the URI to export as
MLFLOW_TRACKING_URI, then serves until Ctrl-C or SIGTERM (which stop the server it started). A server
that exits (killed, out of memory) is started again on the same port, as a process supervisor would
(the head's container has none); `--no-restart` ends the command instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import signal
import sys
import time
from types import FrameType

from service.spec.errors import SpecError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from service.tracking.uri import default_uri, repo_root

    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1).")
    parser.add_argument("--port", type=int, default=5000, help="Port (default: 5000).")
    parser.add_argument(
        "--backend-store-uri",
        default=default_uri(),
        help="sqlite:///PATH, or PostgreSQL: postgresql://USER@HOST:5432/DB (driver: psycopg 3; "
        "password from PGPASSWORD or ~/.pgpass, off the command line) (default: %(default)s)",
    )
    parser.add_argument(
        "--artifacts-destination",
        default=str(repo_root() / "mlartifacts"),
        help="Where the proxied artifacts go: a folder (shared storage on a cluster) or s3://... "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Start the server again when it exits (default: on; "
        f"{MAX_FAILED_STARTS} failed starts in a row end the command).",
    )
    parser.add_argument(
        "--serve-artifacts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Proxy artifact uploads and downloads through the server (default: on).",
    )


def check_host(host: str) -> None:
    """Loopback or a private address; never every interface or a public address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if host == "localhost":
            return
        raise SpecError("--host", f"{host!r} is not an IP address; give 127.0.0.1 or a private one") from None
    if address.is_unspecified or not (address.is_loopback or address.is_private):
        raise SpecError(
            "--host",
            f"{host} would expose MLflow beyond this machine's private network; use 127.0.0.1 and a tunnel "
            "(ssh -L 5000:127.0.0.1:5000) or a private address",
        )


# The URI forms of PostgreSQL that name no driver; SQLAlchemy would pick psycopg2 for them.
_POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def store_uri(uri: str) -> str:
    """`uri` with psycopg (3) as the driver where it is PostgreSQL's and names none; others unchanged.

    >>> store_uri("postgresql://mlflow@10.0.0.5:5432/mlflow")
    'postgresql+psycopg://mlflow@10.0.0.5:5432/mlflow'
    >>> store_uri("postgresql+psycopg2://mlflow@10.0.0.5/mlflow")
    'postgresql+psycopg2://mlflow@10.0.0.5/mlflow'
    >>> store_uri("sqlite:///mlflow.db")
    'sqlite:///mlflow.db'
    """
    for scheme in _POSTGRES_SCHEMES:
        if uri.startswith(scheme):
            return "postgresql+psycopg://" + uri.removeprefix(scheme)
    return uri


def check_driver(uri: str) -> None:
    """A PostgreSQL store's driver is importable here; else one line now, not a traceback from the server."""
    scheme = uri.split("://", 1)[0]
    if not scheme.startswith("postgresql+"):
        return
    driver = scheme.removeprefix("postgresql+")
    if not _importable(driver):  # SQLAlchemy's driver names are their modules' names
        install = "'psycopg[binary]'" if driver == "psycopg" else driver
        raise SpecError(
            "--backend-store-uri", f"PostgreSQL through {driver} needs its package: pip install {install}"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent is missing, or an empty one
        return False


def shown(uri: str) -> str:
    """`uri` with any password masked, for printing."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(uri).render_as_string(hide_password=True)
    except ArgumentError:  # not a database URL (a file store's path): nothing to mask
        return uri


# Keeping the server up, as a process supervisor would (the head's container has none): a server that
# exits is started again after RESTART_DELAY_S; MAX_FAILED_STARTS exits in a row, each within CRASH_LOOP_S
# of its start, end the command (a store that cannot open will not open on the next try either).
RESTART_DELAY_S = 2.0
CRASH_LOOP_S = 60.0
MAX_FAILED_STARTS = 5


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # runs the server's clean-up, as Ctrl-C does


def run(args: argparse.Namespace) -> int:
    check_host(args.host)
    if not 0 < args.port < 65536:
        raise SpecError("--port", f"must be 1-65535, got {args.port}")
    store = store_uri(args.backend_store_uri)
    check_driver(store)
    from service.tracking.server import check_port_free

    try:
        check_port_free(args.host, args.port)
    except RuntimeError as err:  # another server there would answer the new one's health check
        raise SpecError("--port", str(err)) from None
    except ValueError as err:
        raise SpecError("--host", str(err)) from None
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    artifacts = args.artifacts_destination if args.serve_artifacts else None
    failed_starts, first = 0, True
    try:
        while True:
            started = time.monotonic()
            try:
                code = _serve_once(args, store, artifacts, announce=first)
            except (RuntimeError, TimeoutError) as err:  # exited while starting, or never answered
                code = None
                if not args.restart:
                    print(f"error: mlflow server: {err}", file=sys.stderr)
                    return 1
                print(f"mlflow server did not start: {err}", file=sys.stderr)
            if not args.restart:
                print(f"error: mlflow server exited with code {code}", file=sys.stderr)
                return 1
            # A server that ran a while starts again; one that keeps dying at start is given up on.
            first = False
            failed_starts = failed_starts + 1 if time.monotonic() - started < CRASH_LOOP_S else 0
            if failed_starts >= MAX_FAILED_STARTS:
                print(f"error: mlflow server: {failed_starts} failed starts in a row", file=sys.stderr)
                return 1
            print(f"mlflow server exited (code {code}); starting it again", file=sys.stderr, flush=True)
            time.sleep(RESTART_DELAY_S)
    except KeyboardInterrupt:
        return 0


def _serve_once(args: argparse.Namespace, store: str, artifacts: str | None, announce: bool) -> int:
    """Runs the server until it exits; its exit code."""
    from service.tracking.server import mlflow_server_process

    with mlflow_server_process(
        store, args.port, artifacts, host=args.host, serve_artifacts=args.serve_artifacts
    ) as (url, proc):
        where = f"artifacts proxied to {artifacts}" if artifacts else "artifacts not served"
        if announce:
            print(f"MLflow server on {url} (store {shown(store)}; {where}); Ctrl-C to stop")
            print(f"export MLFLOW_TRACKING_URI={url}", flush=True)
        else:
            print(f"MLflow server on {url} again", file=sys.stderr, flush=True)
        return proc.wait()
