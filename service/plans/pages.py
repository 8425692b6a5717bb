"""Ordinary memory pages for the planner's arrays.

NumPy asks Linux for transparent huge pages on every array of 4 MiB or more (`madvise(MADV_HUGEPAGE)`,
on by default; `NUMPY_MADVISE_HUGEPAGE`). Where the kernel's THP defrag setting is `madvise` (a common
default: /sys/kernel/mm/transparent_hugepage/defrag), a fault in such an array may compact memory
synchronously before it returns. A ranking's arrays are column temporaries of up to 10^8 rows, made and
freed many times, each touched once or twice: the compaction is paid again for every temporary and the
TLB gain is small. So enumeration and ranking ask for ordinary pages while they run and give NumPy its
setting back after (benchmarks/enumeration.py times a ranking both ways in the same run).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ENABLED = True  # benchmarks/enumeration.py turns it off to time NumPy's own setting


def _setter() -> Callable[[bool], bool] | None:
    """NumPy's switch (returns the previous value), where this NumPy has one."""
    from numpy._core import multiarray

    return getattr(multiarray, "_set_madvise_hugepage", None)


@contextmanager
def ordinary_pages() -> Iterator[None]:
    """While it lasts, NumPy does not ask for huge pages; its setting is restored after."""
    setter = _setter() if ENABLED else None
    if setter is None:
        yield
        return
    previous = setter(False)
    try:
        yield
    finally:
        setter(previous)


def with_ordinary_pages(fn: F) -> F:
    """`fn` run inside `ordinary_pages()`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with ordinary_pages():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
