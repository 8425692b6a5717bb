"""`on_distinct` gives exactly what evaluating the formula on every row gives, on the lookup path and
on the fallback, for arrays, tuples and scalars."""

from __future__ import annotations

import numpy as np

from service.costmodel import types
from service.costmodel.memory import _stage_layers, stage_layers
from service.costmodel.types import on_distinct


def _formula(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return a * 1000.0 + b, (a % 7) / np.maximum(b, 1)


def test_matches_the_formula_on_every_row(monkeypatch):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 10_000), rng.integers(0, 9, 10_000)
    want = _formula(a, b)
    calls: list[int] = []

    def counted(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        calls.append(len(x))
        return _formula(x, y)

    got = on_distinct(counted, a, b)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert calls == [len(set(zip(a.tolist(), b.tolist(), strict=True)))]  # once per distinct pair
    monkeypatch.setattr(types, "LOOKUP_LIMIT", 10)  # too many combinations: the plain formula
    got = on_distinct(counted, a, b)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)) and calls[-1] == len(a)


def test_broadcasts_scalars_and_keeps_empty_tables():
    assert on_distinct(lambda x, y: x + y, np.array([1, 2, 1]), 5).tolist() == [6, 7, 6]
    assert on_distinct(lambda x: x * 2, np.zeros(0, dtype=np.int64)).shape == (0,)


def test_stage_layers_per_pair_equals_the_formula():
    pp = np.array([1, 2, 4, 8, 16, 3, 4, 2])
    v = np.array([1, 1, 2, 5, 1, 1, 1, 3])
    first, last = stage_layers(61, pp, v)
    want_first, want_last = _stage_layers(61, pp, v)
    assert np.array_equal(first, want_first) and np.array_equal(last, want_last)
    assert stage_layers(61, 4, 2)[0] == want_first[2]  # scalars still take the direct path
