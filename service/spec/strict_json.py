"""Strict JSON (RFC 8259) has no `Infinity` or `NaN`: Python's json module writes them, parsers refuse
them. `non_finite_replaced` walks a JSON-ready value and replaces every float that is not finite, for
the two places that write JSON: `--json` stdout (null, as JSON.stringify writes it) and result.json
(strings pydantic reads back as the number)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def non_finite_replaced(value: Any, replace: Callable[[float], Any]) -> Any:
    """`value` with every float that is not finite replaced by `replace(it)`, in lists and mappings too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else replace(value)
    if isinstance(value, dict):
        return {k: non_finite_replaced(v, replace) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [non_finite_replaced(v, replace) for v in value]
    return value


def as_string(value: float) -> str:
    """ "NaN", "Infinity" or "-Infinity": what pydantic reads back as the float."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
