"""`TrackingSpec`: where searches and proxy runs are recorded (MLflow)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TrackingSpec(BaseModel):
    """MLflow settings; `MLFLOW_TRACKING_URI` in the environment wins over `uri`.

    Example (YAML):
        tracking:
          uri: http://127.0.0.1:5000   # default: sqlite:///<repo>/mlflow.db (artifacts: <repo>/mlartifacts)
          experiment_name: llama2-13b-32xh100
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    uri: str | None = Field(
        None,
        description="MLflow tracking URI; default: sqlite store under the repo (mlflow.db, mlartifacts/).",
    )
    experiment_name: str | None = Field(
        None, description="MLflow experiment; default: the experiment's name."
    )
    artifact_location: str | None = Field(
        None,
        description="Artifact root for a new MLflow experiment; default: `mlartifacts/` next to a sqlite "
        "store, else the server's default.",
    )
    buffer_dir: str | None = Field(
        None,
        description="Where records wait while the tracking store is unreachable; default: "
        "<repo>/mlartifacts/pending. They are written when the store is back.",
    )

    @field_validator("experiment_name")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        # Any MLflow name ("/Users/me/exp" on Databricks) but an empty one; its artifact folder is made
        # safe where it is joined to the root (TrackingTarget.experiment_location).
        if value is not None and not value.strip():
            raise ValueError("must not be empty; leave it out for the experiment's name")
        return value
