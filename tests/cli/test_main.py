"""The CLI's entry point (service/cli/main.py): how failures reach the user."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from service.cli import plan as plan_cli
from service.cli.main import main

TINY = str(Path(__file__).resolve().parents[2] / "experiments" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "err",
    [
        IsADirectoryError(errno.EISDIR, "Is a directory", "/runs/x/memo.html"),
        PermissionError(errno.EACCES, "Permission denied", "/runs/x/result.json"),
        OSError(errno.ENOSPC, "No space left on device", "/runs/x/charts/memory.png"),
    ],
)
def test_a_file_it_cannot_write_or_open_is_one_line_naming_it(monkeypatch, capsys, err):
    def fail(args):  # type: ignore[no-untyped-def]
        raise err

    monkeypatch.setattr(plan_cli, "run", fail)
    assert main(["plan", TINY]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"error: {err.filename}: {err.strerror}")


def test_other_os_errors_are_not_disguised_as_bad_output_paths(monkeypatch):
    def fail(args):  # type: ignore[no-untyped-def]
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")

    monkeypatch.setattr(plan_cli, "run", fail)
    with pytest.raises(ConnectionRefusedError):
        main(["plan", TINY])
