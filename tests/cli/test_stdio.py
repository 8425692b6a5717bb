"""`library_output_to_stderr`: whatever writes to fd 1 inside the block (Python, C, a child process)
ends on stderr; the command's own output after it is alone on stdout (no Ray needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, subprocess, sys
from service.cli.stdio import library_output_to_stderr

with library_output_to_stderr():
    print("(raylet) A worker died or was killed")              # Python-level, buffered
    os.write(1, b"raw fd 1 write from C-level logging\n")       # OS-level
    subprocess.run(["echo", "child process output"], check=True)  # inherits fd 1
    sys.stdout.write("unflushed tail")                         # still in the buffer at the end
print(json.dumps({"status": "ok"}))
"""


def test_only_the_document_reaches_stdout() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, check=True, timeout=60
    )
    assert json.loads(proc.stdout) == {"status": "ok"}
    for line in ("(raylet) A worker died", "raw fd 1 write", "child process output", "unflushed tail"):
        assert line in proc.stderr


def test_print_json_writes_strict_json_with_null_for_numbers_that_are_not_finite(capsys) -> None:
    from service.cli.stdio import print_json

    print_json({"dollars": float("inf"), "mfu": float("nan"), "rows": [1.5, float("-inf")], "n": 3})
    out = capsys.readouterr().out
    assert "Infinity" not in out and "NaN" not in out
    assert json.loads(out) == {"dollars": None, "mfu": None, "rows": [1.5, None], "n": 3}
