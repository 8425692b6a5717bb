"""A production run folder continues only the run that made its checkpoints (service/train/run_identity.py):
another checkpoint or other data in the same folder is refused in one line, not resumed over."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.spec.errors import SpecError
from service.train.hf_data import Packed
from service.train.run_identity import IDENTITY_FILE, check_identity, run_identity


def _weights(folder: Path, hidden: int) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
    return str(folder)


def test_a_folder_of_another_runs_checkpoints_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    data = Packed(train=np.zeros((2, 2, 8), np.int64), eval=np.ones((1, 2, 8), np.int64), tokens=24)
    first = {"plan": "dp2-z3", "init": "a", **run_identity(_weights(tmp_path / "a", 64), data)}
    check_identity(run_dir, first)  # a new run: recorded
    assert json.loads((run_dir / IDENTITY_FILE).read_text()) == first
    (run_dir / "checkpoint_000003").mkdir()
    check_identity(run_dir, first)  # the same run, resumed: fine
    other = {"plan": "dp2-z3", "init": "b", **run_identity(_weights(tmp_path / "b", 128), data)}
    with pytest.raises(SpecError, match="another init, weights_config: it would resume that run") as err:
        check_identity(run_dir, other)
    assert err.value.field == "--storage-path"
    more = Packed(train=np.ones((2, 2, 8), np.int64), eval=data.eval, tokens=24)
    with pytest.raises(SpecError, match="another data"):
        check_identity(run_dir, {**first, "data": run_identity(first["init"], more)["data"]})
