"""The design memo (Markdown and one self-contained HTML page with inline charts), drawn from a
`RunResult` alone, so a finished run's memo can be rebuilt from its `result.json`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.report.result import RunResult


def write_memo(result: RunResult, folder: str | Path) -> dict[str, Path]:
    """Lazy: matplotlib is imported only when a memo is written."""
    from service.report.memo import write_memo as _write

    return _write(result, folder)


__all__ = ["write_memo"]
