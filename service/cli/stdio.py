"""Keeps a command's stdout for its own output while Ray, DeepSpeed and MLflow run.

Those libraries print from background threads and from child processes (Ray's "(raylet) A worker
died ..." line arrives on the driver's stdout when a worker is killed), so a `--json` document would
no longer parse. `library_output_to_stderr()` points file descriptor 1 at stderr for the duration of
the block, at the OS level, so every writer is covered: Python's `print`, C++ logging, and any process
started inside the block (which inherits fd 1). Ray is shut down before fd 1 is given back, so none
of its threads can write after the command's own output.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from service.spec.strict_json import non_finite_replaced


def shutdown_ray() -> None:
    """Stops this process's Ray connection (and a local Ray it started), if any, flushing its output."""
    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextmanager
def library_output_to_stderr(stop_ray: bool = True) -> Iterator[None]:
    """Within the block fd 1 is stderr; afterwards it is the real stdout again.

    Args:
        stop_ray: shut Ray down at the end of the block (its log threads write until then).
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        try:
            if stop_ray:
                shutdown_ray()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)


def print_json(doc: Any, indent: int | None = 2, default: Callable[[Any], Any] | None = None) -> None:
    """Prints `doc` as one strict JSON document (RFC 8259): a number that overflowed or is undefined
    (a price of 1e308 gives infinite dollars) is `null`, as JSON.stringify writes it, not the
    `Infinity` / `NaN` tokens Python's json module writes by default, which JSON parsers refuse."""
    strict = non_finite_replaced(doc, lambda _: None)
    print(json.dumps(strict, indent=indent, default=default, allow_nan=False))
