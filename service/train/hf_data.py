"""The user's own data for fine-tuning: local JSON-lines, Parquet or Arrow files through `datasets`,
tokenised with the checkpoint's tokenizer, packed to the sequence length, split and shuffled with a seed.

Two kinds of rows:
- a text field (default `text`): every token is a target;
- `prompt` / `completion` pairs (when the dataset has both columns): the loss is on the completion only
  (labels −100 on the prompt's tokens, so `cross_entropy` ignores them).

Each row's tokens (and an end-of-sequence token) are concatenated and cut into blocks of `seq_len`; a
block with no target token is dropped. The blocks are shuffled once with the seed; the last
`eval_fraction` of them are the evaluation split. The driver does this once (`pack`) and writes
`train.npy` and `eval.npy` (each `(n, 2, seq_len)` int32: token ids, labels) under the run's folder; the
workers memory-map them (`PackedExamples`). Training sample `i` is block `perm_e[i mod n]` of the
training split, `perm_e` a permutation seeded by (seed, epoch `i // n`): a pure function of `i`, so the
loader's position alone makes resume exact, as with the synthetic tokens (service/train/data.py).
"""

from __future__ import annotations

import functools
import glob
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.spec.errors import SpecError

IGNORE_INDEX = -100
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
TRAIN_FILE, EVAL_FILE = "train.npy", "eval.npy"


def data_files(data: str) -> list[str]:
    """The files of `data`: a file, a glob, a folder (its JSON-lines/Parquet/Arrow files) or a
    comma-separated list of those."""
    files: list[str] = []
    for part in (p.strip() for p in data.split(",") if p.strip()):
        path = Path(part)
        if path.is_dir():
            found = sorted(str(f) for f in path.iterdir() if f.suffix in BUILDERS)
        elif path.is_file():
            found = [str(path)]
        else:
            found = sorted(glob.glob(part))
        if not found:
            raise SpecError("--data", f"no data files at {part}")
        files += found
    kinds = {BUILDERS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise SpecError(
            "--data", f"expected JSON lines (.jsonl/.json), Parquet or Arrow files of one kind, got {files}"
        )
    return files


def load_rows(data: str, text_field: str = "text") -> tuple[Any, str]:
    """The dataset (in memory) and its kind: `pairs` when it has `prompt` and `completion` columns, else
    `text` (it must then have `text_field`)."""
    import datasets

    files = data_files(data)
    empty = [f for f in files if Path(f).stat().st_size == 0]
    if empty:
        raise SpecError("--data", f"{empty[0]} is empty")
    builder = BUILDERS[Path(files[0]).suffix]
    if builder == "json":  # datasets decodes lazily: a bad byte would surface mid-run, as a traceback
        for file in files:
            _check_utf8(Path(file))
    cache = tempfile.mkdtemp(prefix="service-datasets-")
    try:
        datasets.disable_progress_bars()
        rows = datasets.load_dataset(
            builder, data_files=files, split="train", cache_dir=cache, keep_in_memory=True
        )
    except Exception as err:
        raise SpecError("--data", f"cannot read {files[0]}: {type(err).__name__}: {err}") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    columns = list(rows.column_names)
    if "prompt" in columns and "completion" in columns:
        return rows, "pairs"
    if text_field not in columns:
        raise SpecError(
            "--text-field",
            f"the dataset has no {text_field!r} field (nor prompt/completion pairs); its fields: {columns}",
        )
    return rows, "text"


def _check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """A JSON(-lines) data file is UTF-8 text; else one line naming the file and the first bad byte."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with path.open("rb") as f:
        while block := f.read(chunk):
            pending = decoder.getstate()[0]  # a character's first bytes, held back from the last block
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:  # its positions count the held-back bytes first
                data = pending + block
                bad, at = data[err.start], offset - len(pending) + err.start
                raise SpecError("--data", f"{path}: not UTF-8 (byte 0x{bad:02x} at {at})") from None
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise SpecError("--data", f"{path}: not UTF-8 (it ends inside a character)") from None


def _as_text(value: Any, field: str, row: int) -> str:
    if not isinstance(value, str):
        raise SpecError("--data", f"row {row}: field {field!r} is {type(value).__name__}, not text")
    return value


def tokenize(rows: Any, kind: str, tokenizer: Any, text_field: str = "text") -> tuple[np.ndarray, np.ndarray]:
    """All rows' token ids and labels, concatenated (one end-of-sequence token after each row)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    labels: list[int] = []
    for i, row in enumerate(rows):
        if kind == "pairs":
            prompt = tokenizer(_as_text(row["prompt"], "prompt", i))["input_ids"]
            completion = tokenizer(_as_text(row["completion"], "completion", i), add_special_tokens=False)[
                "input_ids"
            ]
            completion = [*completion, eos] if eos is not None else completion
            ids += [*prompt, *completion]
            labels += [IGNORE_INDEX] * len(prompt) + list(completion)
        else:
            tokens = tokenizer(_as_text(row[text_field], text_field, i))["input_ids"]
            tokens = [*tokens, eos] if eos is not None else tokens
            ids += tokens
            labels += tokens
    return np.asarray(ids, dtype=np.int64), np.asarray(labels, dtype=np.int64)


@dataclass
class Packed:
    train: np.ndarray  # (n, 2, seq_len): token ids, labels
    eval: np.ndarray
    tokens: int  # tokens in the dataset


def pack(
    ids: np.ndarray, labels: np.ndarray, seq_len: int, seed: int, eval_fraction: float, vocab_size: int
) -> Packed:
    """Blocks of `seq_len` tokens, shuffled with `seed`, the last `eval_fraction` held out."""
    if ids.size and int(ids.max()) >= vocab_size:
        raise SpecError(
            "--weights",
            f"the tokenizer gives token id {int(ids.max())}, beyond the model's vocab_size {vocab_size}",
        )
    n = ids.size // seq_len
    blocks = np.stack([ids[: n * seq_len], labels[: n * seq_len]], axis=1).reshape(n, seq_len, 2)
    blocks = blocks.transpose(0, 2, 1)  # (n, 2, seq_len)
    blocks = blocks[(blocks[:, 1, 1:] != IGNORE_INDEX).any(axis=1)]  # a target to predict
    blocks = blocks[np.random.default_rng(seed).permutation(len(blocks))]
    held = round(eval_fraction * len(blocks))
    held = max(held, 1) if eval_fraction > 0 else 0
    if len(blocks) - held < 1:
        raise SpecError(
            "--data",
            f"{ids.size} tokens make {len(blocks)} sequences of {seq_len} with a target: too few for a "
            f"training split and an evaluation split of {eval_fraction}",
        )
    cut = len(blocks) - held
    return Packed(blocks[:cut].astype(np.int32), blocks[cut:].astype(np.int32), int(ids.size))


def prepare(
    data: str,
    tokenizer_dir: str,
    *,
    seq_len: int,
    seed: int,
    eval_fraction: float,
    vocab_size: int,
    text_field: str = "text",
    rows: tuple[Any, str] | None = None,
) -> Packed:
    """Reads, tokenises (with the checkpoint's own tokenizer) and packs `data`; `rows` when already read."""
    from transformers import AutoTokenizer

    if not 0 <= eval_fraction < 1:
        raise SpecError("--eval-fraction", f"must be in [0, 1), got {eval_fraction}")
    dataset, kind = rows or load_rows(data, text_field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as err:
        raise SpecError("--weights", f"cannot load the tokenizer of {tokenizer_dir}: {err}") from None
    ids, labels = tokenize(dataset, kind, tokenizer, text_field)
    eos = tokenizer.eos_token_id
    if ids.size and not (ids != eos).any():  # every row tokenised to nothing
        raise SpecError(
            "--weights",
            f"the tokenizer of {tokenizer_dir} turns the data into end-of-sequence tokens only "
            f"({len(tokenizer)} tokens in its vocabulary): not this model's, or its vocabulary is missing",
        )
    return pack(ids, labels, seq_len, seed, eval_fraction, vocab_size)


def write(packed: Packed, directory: str | Path) -> Path:
    """Writes `train.npy` and `eval.npy` into `directory` (each file complete or absent)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for name, array in ((TRAIN_FILE, packed.train), (EVAL_FILE, packed.eval)):
        tmp = out / (name + ".partial")
        with open(tmp, "wb") as f:
            np.save(f, array)
        tmp.replace(out / name)
    return out


class PackedExamples:
    """Training sample `i` of a packed split, `(2, seq_len)` int64 (ids, labels); see the module doc."""

    def __init__(self, path: str | Path, seed: int):
        self.blocks = np.load(path, mmap_mode="r")
        self.seed = seed
        if len(self.blocks) == 0:
            raise ValueError(f"{path}: no sequences")

    def __len__(self) -> int:
        return len(self.blocks)

    @functools.lru_cache(maxsize=2)  # noqa: B019  (one source per worker; the current and next epoch)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.blocks))

    def sample(self, index: int) -> np.ndarray:
        epoch, i = divmod(index, len(self.blocks))
        return np.asarray(self.blocks[self._order(epoch)[i]], dtype=np.int64)

    def block(self, index: int) -> np.ndarray:
        """Block `index` as stored (no shuffling): the evaluation split is read in order."""
        return np.asarray(self.blocks[index], dtype=np.int64)


def labelled_loss(model: torch.nn.Module, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a `(b, 2, seq_len)` batch (ids, labels), prompt tokens (−100) ignored.

    With context parallelism each rank's logits cover its chunk of the sequence: "sum" is its chunk's
    share, and "mean" that share × cp over the whole sequence's targets, so that the mean over the cp
    ranks (DeepSpeed averages their gradients, the worker their losses) is the unsharded mean, as
    `context_parallel.context_parallel_loss` does for unlabelled text."""
    from service.train.context_parallel import chunk_targets, cp_group_of

    out = model(input_ids=batch[:, 0], use_cache=False)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    group = cp_group_of(model)
    targets = batch[:, 1, 1:] if group is None else chunk_targets(batch[:, 1], logits.shape[1], group)
    predicted = logits[:, : targets.shape[1], :].float()
    total = torch.nn.functional.cross_entropy(
        predicted.reshape(-1, predicted.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction=reduction if group is None else "sum",
    )
    if group is None or reduction == "sum":
        return total
    import torch.distributed as dist

    whole = (batch[:, 1, 1:] != IGNORE_INDEX).sum().clamp(min=1)
    return total * dist.get_world_size(group) / whole


def target_count(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Targets (labels other than −100) that `labelled_loss(model, batch, "sum")` sums over on this rank."""
    from service.train.context_parallel import chunk_targets, cp_group_of

    labels = batch[:, 1]
    group = cp_group_of(model)
    if group is None:
        return int((labels[:, 1:] != IGNORE_INDEX).sum())
    import torch.distributed as dist

    local = labels.shape[1] // dist.get_world_size(group)
    return int((chunk_targets(labels, local, group) != IGNORE_INDEX).sum())


def evaluate(engine: Any, split: PackedExamples, dp_rank: int, dp_size: int, micro_batch: int) -> float:
    """Mean loss per target token over the whole evaluation split, identical on every rank.

    Rank `r` takes blocks `r, r + dp, …` in micro-batches; every rank runs the same number of forward
    passes (under ZeRO-3 each forward gathers parameters collectively), padding with block 0 at zero
    weight."""
    import torch.distributed as dist

    n = len(split)
    per_rank = -(-n // dp_size)
    batches = -(-per_rank // micro_batch)
    mine = list(range(dp_rank, n, dp_size))
    totals = torch.zeros(2, dtype=torch.float64)
    was_training = engine.module.training
    engine.module.eval()
    try:
        with torch.no_grad():
            for b in range(batches):
                chunk = mine[b * micro_batch : (b + 1) * micro_batch]
                rows = [split.block(i) for i in chunk] or [split.block(0)]
                batch = torch.from_numpy(np.stack(rows)).to(engine.device)
                loss_sum = labelled_loss(engine, batch, reduction="sum")
                if chunk:
                    totals[0] += float(loss_sum)
                    totals[1] += target_count(engine, batch)  # a context-parallel rank's: its chunk's
    finally:
        engine.module.train(was_training)
    if dist.get_backend() == "nccl":
        totals = totals.cuda()
    dist.all_reduce(totals)
    return float(totals[0] / totals[1].clamp(min=1))


def splits(data_dir: str, seed: int) -> tuple[PackedExamples, PackedExamples | None]:
    """The training and (if any sequences were held out) evaluation splits under `data_dir`."""
    train = PackedExamples(Path(data_dir) / TRAIN_FILE, seed)
    eval_path = Path(data_dir) / EVAL_FILE
    held = np.load(eval_path, mmap_mode="r") if eval_path.exists() else None
    return train, (PackedExamples(eval_path, seed) if held is not None and len(held) else None)
