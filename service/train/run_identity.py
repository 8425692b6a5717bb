"""What a production run folder's checkpoints were trained from, so `service train` continues only the
run that made them. Ray Train restores the latest checkpoint of a run folder (its name is the experiment
and the plan): a second fine-tune of other weights or data in the same folder would load that state
over the new weights, train nothing new and export the earlier run's model as its own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError

IDENTITY_FILE = "run_identity.json"


def run_identity(weights: str, packed: Any) -> dict[str, str]:
    """The checkpoint's config and the packed data (`hf_data.Packed`, or None), by content."""
    config = Path(weights) / "config.json"
    out = {"weights_config": hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else ""}
    if packed is not None:
        out["data"] = hashlib.sha256(packed.train.tobytes() + packed.eval.tobytes()).hexdigest()[:16]
    return out


def check_identity(run_dir: Path, identity: dict[str, str]) -> None:
    """Refuses, in one line, a run folder that holds checkpoints of a run with another identity; records
    `identity` for a new run (or the same one continued)."""
    path = run_dir / IDENTITY_FILE
    if any(run_dir.glob("checkpoint_*")) and path.is_file():
        before = json.loads(path.read_text())
        differ = sorted(k for k in {*before, *identity} if before.get(k) != identity.get(k))
        if differ:
            raise SpecError(
                "--storage-path",
                f"{run_dir} holds checkpoints of a run with another {', '.join(differ)}: it would resume "
                "that run; give another --storage-path (or remove the folder to start over)",
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(identity, indent=1))
