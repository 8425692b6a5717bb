"""How the memo writes numbers: thousands separators, GiB, intervals and the provenance tag of each."""

from __future__ import annotations

from typing import Any

from service.report.result import CALIBRATED, MEASURED, PRIOR, PUBLISHED, Interval
from service.spec.units import GIB

SHORT_TAG = {PRIOR: "prior", PUBLISHED: "published fit", CALIBRATED: "calibrated", MEASURED: "measured"}


def tag(t: str) -> str:
    return f"[{SHORT_TAG.get(t, t)}]"


def fmt_tokens(x: float) -> str:
    return f"{x:,.0f}"


def fmt_hours(x: float) -> str:
    return f"{x:,.2f}"


def fmt_dollars(x: float) -> str:
    return f"${x:,.0f}"


def fmt_gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def with_interval(iv: Interval, fmt: Any, unit: str = "", label: str = "80 %") -> str:
    """`value (label: low–high) [tag]`: `label` "80 %" for an interval checked out of sample, "range" for
    a rule's band (memory: the rule under Extrapolation distance)."""
    if iv.low == iv.high:
        return f"{fmt(iv.value)}{unit} (no interval) {tag(iv.tag)}"
    return f"{fmt(iv.value)}{unit} ({label}: {fmt(iv.low)}–{fmt(iv.high)}{unit}) {tag(iv.tag)}"
