"""Helpers the cost-model tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def seed_experiment_with(tmp_path: Path, **workload: Any) -> Path:
    """The seed experiment (experiments/llama2-13b-32xh100.yaml) with `workload` keys set, written under
    `tmp_path`: a plan of the seed's engines (deepspeed) asked for something only another engine has."""
    data = yaml.safe_load((ROOT / "experiments" / "llama2-13b-32xh100.yaml").read_text())
    data["workload"].update(workload)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
