"""Which MLflow store to write to, and where its artifacts and pending records live.

Precedence (highest first): `MLFLOW_TRACKING_URI` in the environment, the experiment's
`tracking.uri`, the embedded default `sqlite:///<repo>/mlflow.db` with artifacts in
`<repo>/mlartifacts` (so `mlflow ui --backend-store-uri sqlite:///mlflow.db` run in the repo shows them).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from service.spec.names import name_problem
from service.spec.tracking import TrackingSpec


def repo_root() -> Path:
    """The checkout that holds the `service` package (where pyproject.toml is), else the working dir."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "pyproject.toml").is_file() else Path.cwd()


def default_uri() -> str:
    return f"sqlite:///{repo_root() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (None for other stores)."""
    if not uri.startswith("sqlite:"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


def ui_hint(uri: str) -> str:
    """How to see a store's runs: a server's own URL (it serves the UI; on a cluster, through a tunnel
    to the head), else the `mlflow ui` command that serves a database or folder store on this machine.
    `mlflow ui --backend-store-uri http://...` fails ("unsupported URI"), so a server never gets it."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')} (the MLflow server's UI; on a cluster, tunnel to the head first)"
    return f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"


@dataclass(frozen=True)
class TrackingTarget:
    """A resolved store: URI, MLflow experiment, artifact root for new experiments, and pending-record dir."""

    uri: str
    experiment_name: str
    artifact_location: str | None
    buffer_dir: Path

    def experiment_location(self, name: str) -> str | None:
        """Where a new MLflow experiment `name` keeps its artifacts: a folder of its own under the
        artifact root (None: the server's default). A name that is not a plain folder name (MLflow takes
        "/Users/me/exp", and "../x" would climb out of the root) gets a slug of it and a short hash."""
        if not self.artifact_location:
            return None
        folder = name
        if name_problem(name) is not None:
            slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")[:64] or "experiment"
            folder = f"{slug}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
        return f"{self.artifact_location.rstrip('/')}/{folder}"

    @property
    def buffer_file(self) -> Path:
        """One JSONL file per store, so records for one store are never replayed into another."""
        digest = hashlib.sha1(self.uri.encode()).hexdigest()[:12]
        return self.buffer_dir / f"{digest}.jsonl"


# The schemes MLflow's tracking store registry knows (a database's with its driver: postgresql+psycopg).
STORE_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks",
                 "databricks-uc", "uc")  # fmt: skip


def _plugin_schemes() -> set[str]:
    """The schemes of MLflow tracking-store plugins installed here (entry points `mlflow.tracking_store`,
    e.g. azureml-mlflow's `azureml`), which MLflow's registry loads beside its own."""
    from importlib.metadata import entry_points

    return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}


def resolve(spec: TrackingSpec, default_experiment: str) -> TrackingTarget:
    """Applies the precedence above; a sqlite store keeps artifacts in `mlartifacts/` beside its file. A
    URI of no store MLflow knows is a `SpecError` naming where it came from: it is no store that is down,
    whose records would wait for it in the backlog forever."""
    from service.spec.errors import SpecError

    uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.uri or default_uri()
    scheme = urlsplit(uri).scheme.split("+")[0].lower()
    if scheme not in STORE_SCHEMES and scheme not in _plugin_schemes():
        field = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.uri"
        allowed = ", ".join(s + ":" for s in STORE_SCHEMES if s)
        given = urlsplit(uri).scheme + ":"  # the scheme alone: the URI may hold a password
        raise SpecError(field, f"{given!r} is no MLflow tracking store's scheme; allowed: a path, {allowed}")
    artifacts = spec.artifact_location
    db = sqlite_path(uri)
    if artifacts is None and db is not None:
        artifacts = (db.resolve().parent / "mlartifacts").as_uri()
    buffer_dir = Path(spec.buffer_dir) if spec.buffer_dir else repo_root() / "mlartifacts" / "pending"
    return TrackingTarget(
        uri=uri,
        experiment_name=spec.experiment_name or default_experiment,
        artifact_location=artifacts,
        buffer_dir=buffer_dir,
    )
