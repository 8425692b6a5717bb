"""A runs file as CSV (service/calibrate/runs.py reads YAML or this): one row per run, the columns id,
source, model, gpu, num_gpus, gpus_per_node, dp, tp, pp, zero_stage, micro_batch, grad_accum,
global_batch, seq_len, recompute and one of tokens_per_s_per_gpu / step_time_s, as a spreadsheet writes
them (a byte-order mark, spaces after the commas, trailing empty cells). A cell that cannot be read is a
one-line `SpecError` naming the file, the row and the column.

How a source's kernels ran (`SOURCE_FLAGS`: flash_attention, cudnn_attention, fused_elementwise,
fused_cross_entropy; yes/no columns, the same on every row of a source) defaults to what `estimate` and
`plan` assume for a run today (`Workload`'s defaults), so a set fit on the user's runs predicts those
same runs as they were measured."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from service.spec import SpecError

CSV_INT_FIELDS: tuple[str, ...] = ("num_gpus", "gpus_per_node", "dp", "tp", "pp", "cp", "zero_stage")
CSV_INT_FIELDS += ("micro_batch", "grad_accum", "global_batch", "seq_len")
CSV_TRUE: tuple[str, ...] = ("1", "true", "yes")
CSV_FALSE: tuple[str, ...] = ("0", "false", "no")
SOURCE_FLAGS: tuple[str, ...] = (
    "flash_attention",
    "cudnn_attention",
    "fused_elementwise",
    "fused_cross_entropy",
)


def csv_dataset(path: Path) -> dict[str, Any]:
    """A CSV runs file as the YAML format's dict (one source entry per distinct `source`)."""
    with path.open(newline="", encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark is no header
        rows = list(csv.DictReader(f))
    measurements = []
    for i, raw in enumerate(rows):
        extra = raw.get(None) or []  # type: ignore[call-overload]  # DictReader keeps cells past the header
        if any(str(cell).strip() for cell in extra):  # a spreadsheet's trailing empty cells are no data
            message = f"line {i + 2} has more cells than the header names"
            raise SpecError(f"measurements.{i}", message, str(path))
        row: dict[str, Any] = {k.strip(): v.strip() for k, v in raw.items() if k and v and v.strip()}
        measured = {}
        for k in ("tokens_per_s_per_gpu", "step_time_s"):
            if k in row:
                value = row.pop(k)
                try:
                    measured[k] = float(value)
                except ValueError:
                    message = f"not a number: {value!r} (line {i + 2})"
                    raise SpecError(f"measurements.{i}.{k}", message, str(path)) from None
        for k in CSV_INT_FIELDS:
            if k in row:
                try:
                    row[k] = int(row[k])
                except ValueError:
                    message = f"not an integer: {row[k]!r} (line {i + 2})"
                    raise SpecError(f"measurements.{i}.{k}", message, str(path)) from None
        for k in ("sequence_parallel", "comm_overlap", "tp_comm_overlap", "approximate", *SOURCE_FLAGS):
            if k in row:
                flag = row[k].lower()
                if flag not in CSV_TRUE + CSV_FALSE:
                    allowed = ", ".join(CSV_TRUE + CSV_FALSE)
                    message = f"not a yes/no value: {row[k]!r} (line {i + 2}; allowed: {allowed})"
                    raise SpecError(f"measurements.{i}.{k}", message, str(path))
                row[k] = flag in CSV_TRUE
        row.setdefault("ref", f"{path.name} row {i + 2}")
        measurements.append({**row, "measured": measured})
    return {"sources": _sources(measurements, path), "models": {}, "measurements": measurements}


def _sources(measurements: list[dict[str, Any]], path: Path) -> dict[str, dict[str, Any]]:
    """One source entry per distinct `source`, with its kernels (`SOURCE_FLAGS`, popped from its rows)."""
    from service.spec.workload import Workload

    defaults = {k: Workload.model_fields[k].default for k in SOURCE_FLAGS}
    stated: dict[str, dict[str, tuple[bool, int]]] = {}  # source → flag → (value, line it was stated on)
    for i, m in enumerate(measurements):
        mine = stated.setdefault(str(m.get("source", "")), {})
        for k in [k for k in SOURCE_FLAGS if k in m]:  # a blank cell states nothing
            value, line = m.pop(k), i + 2
            first = mine.setdefault(k, (value, line))
            if first[0] != value:
                message = f"{value} on line {line}, {first[0]} on line {first[1]} of the same source"
                raise SpecError(f"measurements.{i}.{k}", message, str(path))
    return {
        name: {"citation": str(path), "framework": "", "metric": "", **defaults,
               **{k: v for k, (v, _) in flags.items()}}
        for name, flags in stated.items()
    }  # fmt: skip
