"""`Num`: what the per-term formulas take: a numpy array (one element per plan) or a plain number; and
`on_distinct`, which evaluates a formula once per distinct combination of a plan table's small
integer columns."""

from collections.abc import Callable
from math import prod
from typing import Any, TypeAlias

import numpy as np

Num: TypeAlias = np.ndarray | float

# Above this many possible combinations the dense lookup table would cost more than it saves.
LOOKUP_LIMIT = 1 << 20


def on_distinct(fn: Callable[..., Any], *columns: Num) -> Any:
    """`fn(*columns)`, computed only on the distinct combinations of `columns` (non-negative integers)
    and spread back to every plan: `fn` returns an array or a tuple of arrays, one element per
    combination.

    A large plan table holds millions of plans but a few dozen (pp, v) or (tp, pp) pairs, so a formula
    of those columns alone (blocks per pipeline stage, gradient buckets) runs on the pairs; the
    combinations are found through a dense lookup table of the columns' ranges, without sorting.
    """
    cols = np.broadcast_arrays(*(np.asarray(c, dtype=np.int64) for c in columns))
    if cols[0].size == 0:
        return fn(*cols)
    shape = tuple(int(c.max()) + 1 for c in cols)
    if prod(shape) > LOOKUP_LIMIT or int(min(c.min() for c in cols)) < 0:
        return fn(*cols)
    flat = np.ravel_multi_index(tuple(cols), shape)
    present = np.zeros(prod(shape), dtype=bool)
    present[flat] = True
    codes = np.flatnonzero(present)
    position = np.zeros(prod(shape), dtype=np.int64)
    position[codes] = np.arange(len(codes))
    at = position[flat]
    out = fn(*np.unravel_index(codes, shape))
    if isinstance(out, tuple):
        return tuple(np.asarray(o)[at] for o in out)
    return np.asarray(out)[at]


def on_distinct_ints(fn: Callable[..., Any], *columns: Num) -> Any:
    """`on_distinct` where every column is an integer (or bool) array of more than one element, a plan
    table's; `fn(*columns)` as it is otherwise (a single plan, fractional values)."""
    arrays = [np.asarray(c) for c in columns]
    if all(a.dtype.kind in "iub" for a in arrays) and max(a.size for a in arrays) > 1:
        return on_distinct(fn, *columns)
    return fn(*columns)
