"""Token data for proxy runs: a seeded synthetic stream or a memory-mapped binary file of token ids,
sharded by data-parallel rank, with a position that checkpoints record.

Sample `i` of the global stream is a pure function of `i` (and the seed or file), so a rank that resumes
at position `k` reads exactly what an uninterrupted run would have read: rank `r` of `dp` takes, for its
`k`-th micro-batch of `b` sequences, the global samples `(k·dp + r)·b … (k·dp + r)·b + b − 1`.
Ranks of one tensor- or pipeline-parallel group share a data-parallel rank and so read the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch


class TokenSource(Protocol):
    """Anything that yields sample `i` (one sequence of `seq_len` token ids)."""

    def sample(self, index: int) -> np.ndarray: ...


class SyntheticTokens:
    """Seeded, learnable synthetic sequences: `tok[t] = (start + stride·t) mod V`, with `start` and
    `stride` drawn from a generator seeded by (seed, index), so the loss falls as the proxy learns the rule
    (a flat loss would hide a broken optimizer)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        start, stride = rng.integers(0, self.vocab_size), rng.integers(1, 8)
        return ((start + stride * np.arange(self.seq_len)) % self.vocab_size).astype(np.int64)


def token_dtype(path: str | Path, vocab_size: int) -> type[np.unsignedinteger]:
    """uint16 when every id fits (nanoGPT's `.bin` convention), uint32 for larger vocabularies or `.u32`."""
    return np.uint32 if vocab_size > 65536 or str(path).endswith(".u32") else np.uint16


class TokenFile:
    """A flat binary file of token ids, memory-mapped; sample `i` is the `i`-th window of `seq_len`
    tokens (wrapping around), so the file is read lazily and never copied whole into memory."""

    def __init__(self, path: str | Path, vocab_size: int, seq_len: int):
        self.tokens = np.memmap(path, dtype=token_dtype(path, vocab_size), mode="r")
        self.seq_len = seq_len
        self.num_samples = len(self.tokens) // seq_len
        if self.num_samples == 0:
            raise ValueError(f"{path}: {len(self.tokens)} tokens, fewer than one sequence of {seq_len}")
        if int(self.tokens.max()) >= vocab_size:
            raise ValueError(f"{path}: token id {int(self.tokens.max())} >= vocab_size {vocab_size}")

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.num_samples) * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len], dtype=np.int64)


def write_token_file(path: str | Path, tokens: np.ndarray, vocab_size: int) -> Path:
    """Writes `tokens` in the format `TokenFile` reads (for tests and for preparing a corpus)."""
    p = Path(path)
    np.asarray(tokens).astype(token_dtype(p, vocab_size)).tofile(p)
    return p


def token_source(data: str, vocab_size: int, seq_len: int, seed: int) -> TokenSource:
    """`synthetic` or a path to a token file (ProxySpec.data)."""
    if data == "synthetic":
        return SyntheticTokens(vocab_size, seq_len, seed)
    return TokenFile(data, vocab_size, seq_len)


class ShardedLoader:
    """Micro-batches for one data-parallel rank; `position` counts the micro-batches it has consumed."""

    def __init__(self, source: TokenSource, dp_rank: int, dp_size: int, micro_batch: int, position: int = 0):
        self.source, self.dp_rank, self.dp_size, self.micro_batch = source, dp_rank, dp_size, micro_batch
        self.position = position

    def sample_indices(self, position: int) -> list[int]:
        first = (position * self.dp_size + self.dp_rank) * self.micro_batch
        return list(range(first, first + self.micro_batch))

    def next_micro_batch(self) -> torch.Tensor:
        rows = [self.source.sample(i) for i in self.sample_indices(self.position)]
        self.position += 1
        return torch.from_numpy(np.stack(rows))

    def __iter__(self) -> ShardedLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) as DeepSpeed's pipeline engine reads them; labels = inputs (the loss shifts)."""
        batch = self.next_micro_batch()
        return batch, batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(
                f"checkpoint data shard {state} does not match rank {self.dp_rank} of {self.dp_size}"
            )
        self.position = int(state["position"])
