"""`TrackingSpec`: where searches and proxy runs are recorded (MLflow)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrackingSpec(BaseModel):
    """MLflow settings; `MLFLOW_TRACKING_URI` in the environment wins over `uri`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str | None = Field(None, description="MLflow tracking URI; default: sqlite store under the repo (mlruns/).")
    experiment_name: str | None = Field(None, description="MLflow experiment; default: the experiment's name.")
