"""`service train --weights DIR --data FILE` (issue #31): fine-tuning a local Hugging Face checkpoint on
local data. A tiny Llama (2 layers, hidden 64) with random weights and a WordLevel tokenizer trained on
the test's own text are saved here (no downloads); the experiment is tiny-cpu with that model.

Fast: the data path (packing, prompt-only labels, the seeded sample order) and every refusal (a config
mismatch, a missing folder/config/tokenizer, a missing field, a sequence length beyond the checkpoint's
positions), each one line and before anything is written.
Slow: ZeRO-3 over 2 CPU workers under Ray Train: the loss falls, the evaluation loss reaches MLflow, and
the exported `hf_model/` reloads with `from_pretrained` and gives the trained model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from service.spec import Plan
from service.spec.errors import SpecError
from service.train import hf_data
from service.train.production import ProductionRun

VOCAB = 256
MODEL = {
    "name": "tiny-ft",
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "ffn_hidden_size": 128,
    "vocab_size": VOCAB,
    "mlp": "swiglu",
}
WORDS = [f"w{i}" for i in range(200)]
Z3 = Plan(dp=2, zero_stage=3, micro_batch=2, grad_accum=1, precision="fp32")


def _texts(rows: int = 120) -> list[str]:
    """Learnable rows: runs of consecutive words (`w7 w8 w9 …`), as the synthetic tokens are."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(rows):
        start, length = int(rng.integers(0, 150)), int(rng.integers(12, 40))
        out.append(" ".join(WORDS[(start + k) % len(WORDS)] for k in range(length)))
    return out


def save_checkpoint(folder: Path, *, tokenizer: bool = True, **config: object) -> Path:
    """A random-weight tiny Llama saved as `save_pretrained` writes it, with a local WordLevel tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        **config,
    }
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder)
    if tokenizer:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.train_from_iterator(
            [*_texts(), " ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
        )
        fast.save_pretrained(folder)
    return folder


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def experiment_file(tmp: Path, seq_len: int = 64) -> Path:
    data = yaml.safe_load(Path("experiments/tiny-cpu.yaml").read_text())
    data["name"] = "tiny-ft"
    data["model"] = MODEL
    data["workload"]["seq_len"] = seq_len
    data["proxy"].update({"num_layers": 2, "warmup_steps": 1})
    path = tmp / f"tiny-ft-{seq_len}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture
def text_data(tmp_path) -> str:
    return write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in _texts()])


def _refusal(tmp_path: Path, **kwargs: object) -> str:
    """The one-line error of a ProductionRun that must not start; nothing was written."""
    storage = tmp_path / "runs"
    kwargs = {"plan": Z3, "track": False, "storage_path": storage, **kwargs}
    with pytest.raises(SpecError) as err:
        ProductionRun(kwargs.pop("experiment", experiment_file(tmp_path)), **kwargs)  # type: ignore[arg-type]
    assert not storage.exists()
    message = str(err.value)
    assert "\n" not in message
    return message


# --- fast: the data --------------------------------------------------------------------------------


def test_prompt_completion_pairs_put_the_loss_on_the_completion_only(checkpoint, tmp_path):
    from transformers import AutoTokenizer

    rows = [{"prompt": f"w{i} w{i + 1} w{i + 2}", "completion": f"w{i + 3} w{i + 4}"} for i in range(60)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    dataset, kind = hf_data.load_rows(data)
    assert kind == "pairs"
    ids, labels = hf_data.tokenize(dataset, kind, AutoTokenizer.from_pretrained(checkpoint))
    # each row: 3 prompt tokens (ignored), 2 completion tokens and </s> (targets)
    assert len(ids) == 6 * 60 and (labels == hf_data.IGNORE_INDEX).sum() == 3 * 60
    first = labels[:6].tolist()
    assert first[:3] == [-100] * 3 and first[3:] == ids[3:6].tolist()
    packed = hf_data.pack(ids, labels, seq_len=16, seed=7, eval_fraction=0.1, vocab_size=VOCAB)
    assert packed.train.shape[1:] == (2, 16) and len(packed.eval) == 2 and len(packed.train) == 20
    again = hf_data.pack(ids, labels, seq_len=16, seed=7, eval_fraction=0.1, vocab_size=VOCAB)
    assert np.array_equal(packed.train, again.train)  # the seed fixes the split and the order


def test_parquet_and_arrow_files_read_as_json_lines_do(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": ["w1 w2 w3", "w4 w5"], "id": [1, 2]})
    pq.write_table(table, tmp_path / "d.parquet")
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table)
    for name in ("d.parquet", "d.arrow"):
        rows, kind = hf_data.load_rows(str(tmp_path / name))
        assert kind == "text" and rows["text"] == ["w1 w2 w3", "w4 w5"]


def test_sample_i_is_a_pure_function_of_i(checkpoint, tmp_path, text_data):
    packed = hf_data.prepare(
        text_data, str(checkpoint), seq_len=32, seed=3, eval_fraction=0.05, vocab_size=VOCAB
    )
    hf_data.write(packed, tmp_path / "data")
    train, held = hf_data.splits(str(tmp_path / "data"), seed=3)
    assert held is not None and len(held) == len(packed.eval) >= 1
    n = len(train)
    first = [train.sample(i) for i in range(2 * n + 3)]
    fresh, _ = hf_data.splits(str(tmp_path / "data"), seed=3)  # a resumed worker reads the same
    assert all(np.array_equal(fresh.sample(i), first[i]) for i in (0, n - 1, n, 2 * n + 2))
    epoch0 = {first[i].tobytes() for i in range(n)}
    assert len(epoch0) == n  # each block once per epoch, in a seeded order that changes per epoch
    assert any(not np.array_equal(first[i], first[n + i]) for i in range(n))


# --- fast: refusals, one line each, before anything is written --------------------------------------


def test_config_mismatch_names_the_field_and_both_values(tmp_path):
    wide = save_checkpoint(tmp_path / "wide", hidden_size=128, intermediate_size=128)
    message = _refusal(tmp_path, weights=wide)
    assert "hidden_size is 128 but the experiment's model.hidden_size is 64" in message
    kv = save_checkpoint(tmp_path / "kv", num_key_value_heads=4)
    assert "num_key_value_heads is 4 but the experiment's model.num_key_value_heads is 2" in _refusal(
        tmp_path, weights=kv
    )


def test_missing_folder_config_weights_or_tokenizer(checkpoint, tmp_path):
    assert "no such checkpoint folder" in _refusal(tmp_path, weights=tmp_path / "nowhere")
    bare = save_checkpoint(tmp_path / "bare", tokenizer=False)
    assert "has no tokenizer vocabulary" in _refusal(tmp_path, weights=bare)
    # a tokenizer_config.json alone names a class: transformers builds an empty tokenizer from it
    (bare / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    assert "has no tokenizer vocabulary (tokenizer.json or tokenizer.model or vocab.json)" in _refusal(
        tmp_path, weights=bare
    )
    (bare / "config.json").unlink()
    assert "has no config.json" in _refusal(tmp_path, weights=bare)


def test_data_that_is_not_utf8_is_refused_before_anything_runs(checkpoint, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"text": "w1 w2"}\n' * 50 + '{"text": "caf\u00e9 w1"}\n'.encode("latin-1"))
    message = _refusal(tmp_path, weights=checkpoint, data=str(data))
    assert message == f"--data: {data}: not UTF-8 (byte 0xe9 at {50 * 18 + 13})"  # 18 bytes a line


def test_an_empty_data_file_and_evaluating_nothing_are_refused(checkpoint, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert _refusal(tmp_path, weights=checkpoint, data=str(empty)) == f"--data: {empty} is empty"
    data = write_jsonl(tmp_path / "x.jsonl", [{"text": "w1 w2"}])
    message = _refusal(tmp_path, weights=checkpoint, data=data, eval_fraction=0.0, eval_every=5)
    assert message == "--eval-every: needs --eval-fraction above 0 (the share held out to evaluate)"


def test_missing_field_and_too_long_sequences(checkpoint, tmp_path):
    data = write_jsonl(tmp_path / "x.jsonl", [{"body": "w1 w2"}])
    message = _refusal(tmp_path, weights=checkpoint, data=data)
    assert message.startswith("--text-field: the dataset has no 'text' field") and "body" in message
    long = experiment_file(tmp_path, seq_len=256)
    message = _refusal(tmp_path, experiment=long, weights=checkpoint)
    assert message == (
        f"workload.seq_len: 256 is above the checkpoint's max_position_embeddings 128 "
        f"({checkpoint / 'config.json'})"
    )
    assert "needs --weights" in _refusal(tmp_path, data=data)


def test_cli_refuses_a_mismatched_checkpoint_in_one_line(checkpoint, tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "service", "train", "experiments/tiny-cpu.yaml", "--plan",
           "dp2-tp1-pp1-z1-mb4-ga1-rc:none", "--weights", str(checkpoint), "--eval-every", "2",
           "--storage-path", str(tmp_path / "runs")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert "hidden_size is 64 but the experiment's model.hidden_size is 128" in proc.stderr
    assert not (tmp_path / "runs").exists()


# --- slow: ZeRO-3 fine-tuning on 2 CPU workers -----------------------------------------------------

STEPS = 6
EVAL_EVERY = 3


class FineTuned:
    """One ZeRO-3 fine-tuning run, shared by the module's slow tests (and how to start another)."""

    def __init__(self, folder: Path, checkpoint: Path):
        self.folder, self.checkpoint = folder, checkpoint
        self.store = f"sqlite:///{folder / 'mlflow.db'}"
        self.data = write_jsonl(folder / "train.jsonl", [{"text": t} for t in _texts()])
        self.result = self.run("ft")

    def run(self, name: str, **kwargs: object):  # -> ProductionResult
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_URI", self.store)
            production = ProductionRun(
                experiment_file(self.folder),
                Z3,
                steps=STEPS,
                storage_path=self.folder / "runs",
                run_name=name,
                weights=self.checkpoint,
                data=self.data,
                eval_every=EVAL_EVERY,
                **kwargs,  # type: ignore[arg-type]
            )
            return production.fit()


@pytest.fixture(scope="module")
def finetuned(checkpoint, tmp_path_factory) -> FineTuned:
    return FineTuned(tmp_path_factory.mktemp("finetune"), checkpoint)


@pytest.mark.slow
@pytest.mark.xdist_group("trials")  # as tests/conftest.py puts every tests/train module
def test_zero3_finetune_lowers_the_loss_and_exports_reloadable_weights(finetuned, checkpoint):
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.train.weights import PROBE_FILE

    result = finetuned.result
    assert result.status == "ok", result.reason
    print(f"losses {result.losses} eval {result.eval_losses} wall {result.wall_s:.1f}s")
    assert len(result.losses) == STEPS and result.losses[-1] < result.losses[0]
    assert sorted(result.eval_losses) == [3, 6]
    assert result.eval_losses[6] < result.eval_losses[3]

    client = MlflowClient(tracking_uri=finetuned.store)
    mlrun = client.get_run(result.mlflow_run_id)
    assert mlrun.data.tags["init"] == str(checkpoint) and mlrun.info.status == "FINISHED"
    evals = {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, "eval_loss")}
    assert evals == result.eval_losses
    assert {a.path for a in client.list_artifacts(result.mlflow_run_id, "hf_model")} >= {
        "hf_model/config.json",
        "hf_model/model.safetensors",
    }

    exported = Path(result.hf_model_dir or "")
    assert exported == finetuned.folder / "runs" / "ft" / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    assert len(AutoTokenizer.from_pretrained(exported)) == len(AutoTokenizer.from_pretrained(checkpoint))
    probe = torch.load(exported.parent / PROBE_FILE)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits
    diff = float((logits - probe["logits"]).abs().max())
    print(f"exported-vs-trained logits max |diff| {diff:.3g}")
    assert diff < 1e-4  # the plan computes in fp32 on CPU
    before = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        assert float((before(input_ids=probe["input_ids"]).logits - logits).abs().max()) > 1e-3  # trained


@pytest.mark.slow
@pytest.mark.xdist_group("trials")
def test_a_killed_finetune_resumes_on_the_same_data_bitwise(finetuned):
    """A worker killed at step 4 restarts from the step-2 checkpoint: the reloaded checkpoint is
    overwritten by DeepSpeed's state and the packed data's position, so losses and evaluation losses
    are bitwise the uninterrupted run's. The killed run's workers are the tests' local processes
    (tests/train/local_workers.py), restarted as Ray Train restarts them; Ray Train's own restart of a
    killed worker is tests/cluster/test_production.py's."""
    from tests.train import local_workers

    killed = finetuned.run(
        "killed", checkpoint_every=2, max_failures=1, inject_failure_at_step=4, launch=local_workers.launch
    )
    assert killed.status == "ok" and killed.restarts == 1, killed.reason
    print(f"killed run: losses {killed.losses} wall {killed.wall_s:.1f}s")
    assert killed.losses == finetuned.result.losses  # bitwise: float equality
    assert killed.eval_losses == finetuned.result.eval_losses
