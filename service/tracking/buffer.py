"""Records that could not reach the tracking store, kept on local disk until it is back.

Each record is one JSON line (an operation the `Tracker` would have sent: create a run, log a batch,
log an artifact, end a run). Artifacts are copied next to the file at the time of the failure, since
the trial folder they came from may be gone by the time the store is back. Appends are flushed and
fsynced: a search that dies right after a failure still keeps what it measured.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


class PendingRecords:
    """An append-only JSONL file of operations plus a folder of artifact copies."""

    def __init__(self, path: Path):
        self.path = path
        self.files_dir = path.with_suffix(".files")

    def __len__(self) -> int:
        return len(self.load())

    def append(self, op: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if op.get("op") == "log_artifact" and not _is_inside(Path(op["local_path"]), self.files_dir):
            op = {**op, "local_path": str(self.stash(Path(op["local_path"])))}
        with self.path.open("a") as f:
            f.write(json.dumps(op, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def stash(self, local_path: Path) -> Path:
        """Copies an artifact (file or folder) under `files_dir`; a missing one is recorded as missing."""
        dest = self.files_dir / uuid.uuid4().hex / local_path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if local_path.is_dir():
            shutil.copytree(local_path, dest)
        elif local_path.is_file():
            shutil.copy2(local_path, dest)
        else:
            dest.write_text(f"artifact {local_path} was missing when the tracking store was unreachable\n")
        return dest

    def load(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def keep_only(self, ops: list[dict[str, Any]]) -> None:
        """Rewrites the file with `ops` (the ones not yet written), atomically; drops unused copies."""
        if not ops:
            self.path.unlink(missing_ok=True)
            shutil.rmtree(self.files_dir, ignore_errors=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(op, sort_keys=True) + "\n" for op in ops))
        tmp.replace(self.path)
        still_used = {Path(op["local_path"]).parent for op in ops if op.get("op") == "log_artifact"}
        if self.files_dir.is_dir():
            for folder in self.files_dir.iterdir():
                if folder not in still_used:
                    shutil.rmtree(folder, ignore_errors=True)


def _is_inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False
