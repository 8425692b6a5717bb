"""Token data: deterministic samples, disjoint data-parallel shards, exact resume, memory-mapped files."""

from __future__ import annotations

import numpy as np
import pytest

from service.train.data import ShardedLoader, SyntheticTokens, TokenFile, token_source, write_token_file


def test_synthetic_samples_are_pure_functions_of_index_and_seed():
    a, b = SyntheticTokens(512, 16, seed=1), SyntheticTokens(512, 16, seed=1)
    assert np.array_equal(a.sample(7), b.sample(7))
    assert not np.array_equal(a.sample(7), a.sample(8))
    assert not np.array_equal(a.sample(7), SyntheticTokens(512, 16, seed=2).sample(7))
    s = a.sample(3)
    assert s.shape == (16,) and s.min() >= 0 and s.max() < 512
    stride = (s[1] - s[0]) % 512
    assert all((s[i + 1] - s[i]) % 512 == stride for i in range(15))  # the learnable rule


def test_ranks_read_disjoint_shards_that_cover_the_global_batch():
    source = SyntheticTokens(512, 8, seed=0)
    loaders = [ShardedLoader(source, r, 2, micro_batch=3) for r in range(2)]
    seen = [i for ld in loaders for k in range(2) for i in ld.sample_indices(k)]
    assert sorted(seen) == list(range(12))


def test_resumed_loader_continues_exactly():
    source = SyntheticTokens(512, 8, seed=0)
    full = ShardedLoader(source, 1, 2, micro_batch=2)
    batches = [full.next_micro_batch() for _ in range(4)]
    part = ShardedLoader(source, 1, 2, micro_batch=2)
    part.next_micro_batch(), part.next_micro_batch()
    resumed = ShardedLoader(source, 1, 2, micro_batch=2)
    resumed.load_state_dict(part.state_dict())
    assert all(np.array_equal(resumed.next_micro_batch(), b) for b in batches[2:])
    with pytest.raises(ValueError, match="does not match"):
        ShardedLoader(source, 0, 2, micro_batch=2).load_state_dict(part.state_dict())


def test_token_file_is_memory_mapped_and_windowed(tmp_path):
    tokens = np.arange(100) % 50
    path = write_token_file(tmp_path / "corpus.bin", tokens, vocab_size=50)
    assert path.stat().st_size == 200  # uint16
    f = TokenFile(path, vocab_size=50, seq_len=10)
    assert isinstance(f.tokens, np.memmap) and f.num_samples == 10
    assert np.array_equal(f.sample(3), tokens[30:40])
    assert np.array_equal(f.sample(13), tokens[30:40])  # wraps around
    assert isinstance(token_source(str(path), 50, 10, seed=0), TokenFile)
    with pytest.raises(ValueError, match="vocab_size"):
        TokenFile(path, vocab_size=20, seq_len=10)


def test_large_vocabularies_use_uint32(tmp_path):
    path = write_token_file(tmp_path / "big.bin", np.array([70000, 1, 2, 3]), vocab_size=100000)
    assert path.stat().st_size == 16
    assert TokenFile(path, 100000, 2).sample(0).tolist() == [70000, 1]


def test_a_tokenizer_that_makes_nothing_of_the_data_is_refused(tmp_path, monkeypatch):
    """A checkpoint folder whose tokenizer files were lost gets an empty tokenizer from transformers:
    every row becomes one end-of-sequence token, a fine-tune on nothing."""
    import transformers

    from service.spec.errors import SpecError
    from service.train import hf_data

    class Empty:
        eos_token_id = 2

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": []}

        def __len__(self) -> int:
            return 3

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Empty())
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"text": "w{i} w{i + 1}"}}\n' for i in range(20)))
    with pytest.raises(SpecError, match="turns the data into end-of-sequence tokens only"):
        hf_data.prepare(str(data), "ckpt", seq_len=8, seed=0, eval_fraction=0.1, vocab_size=64)


def test_a_bad_byte_after_a_character_split_across_reads_is_named_where_it_is(tmp_path):
    from service.spec.errors import SpecError
    from service.train.hf_data import _check_utf8

    path = tmp_path / "d.jsonl"
    path.write_bytes(b"aaa" + "\u00e9".encode() + b"xy\xff")  # é straddles the 4-byte reads
    with pytest.raises(SpecError, match=r"not UTF-8 \(byte 0xff at 7\)"):
        _check_utf8(path, chunk=4)
    path.write_bytes(b"aaa" + "\u00e9".encode() + b"\xff")
    with pytest.raises(SpecError, match=r"not UTF-8 \(byte 0xff at 5\)"):
        _check_utf8(path, chunk=4)
