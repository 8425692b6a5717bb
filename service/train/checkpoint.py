"""Exact resume: DeepSpeed engine state plus everything else a step depends on, per rank.

A checkpoint directory holds DeepSpeed's files for tag `step<N>` (model, optimizer and scheduler state;
each rank writes only its own shard files, so per-rank directories merge into one without clashes, as
Ray Train does when every worker reports a checkpoint) and one `worker_rank<R>.pt` per rank with the
Python, NumPy and torch RNG states, the data loader position and the step reached.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _worker_file(directory: Path, rank: int) -> Path:
    return directory / f"worker_rank{rank}.pt"


def save(engine: Any, directory: str | Path, step: int, rank: int, loader_state: dict[str, int]) -> str:
    """Saves the engine and this rank's worker state after `step` steps; returns the DeepSpeed tag."""
    tag = f"step{step}"
    directory = Path(directory)
    engine.save_checkpoint(str(directory), tag=tag)
    torch.save(
        {"step": step, "tag": tag, "rng": rng_state(), "data": loader_state}, _worker_file(directory, rank)
    )
    return tag


def load(engine: Any, directory: str | Path, rank: int) -> dict[str, Any]:
    """Restores the engine and this rank's RNG states; returns the worker state (step, data position)."""
    directory = Path(directory)
    state = torch.load(_worker_file(directory, rank), weights_only=False)
    load_path, _ = engine.load_checkpoint(
        str(directory), tag=state["tag"], load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint {state['tag']} in {directory}")
    set_rng_state(state["rng"])
    return state
