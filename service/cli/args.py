"""argparse types for numeric flags: a bad value is argparse's one-line error naming the flag.

`type=float` takes "nan" and "inf", which then reach the JSON output as NaN / Infinity (not JSON); and
`type=int` takes 0 and negatives where only a count makes sense. `output_path` checks a `--out` before a
command does any work."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def output_path(flag: str, path: str, folder: bool = False) -> Path:
    """Where a `--out` flag writes, checked before any work: its parent folder must exist (nothing the
    user did not ask for is created), and a file path must not be a folder (nor a folder path a file).
    A `SpecError` naming the flag otherwise."""
    from service.spec.errors import SpecError

    want = "a folder" if folder else "a file"
    if not path.strip():
        raise SpecError(flag, f"empty; give {want} path, or leave the flag out for the default")
    p = Path(path).expanduser()
    try:
        os.stat(p)  # a name too long for the file system fails here, before any work
    except FileNotFoundError:
        pass
    except OSError as err:
        raise SpecError(flag, f"{path}: {err.strerror}") from None
    if p.is_dir() and not folder:
        raise SpecError(flag, f"{path} is a folder; give {want} path")
    if p.exists() and folder and not p.is_dir():
        raise SpecError(flag, f"{path} is a file, not a folder")
    parent = p.absolute().parent
    if not parent.is_dir():
        raise SpecError(flag, f"folder {parent} does not exist; create it first (nothing is created for you)")
    if p.exists() and not (p.is_dir() or p.is_file()):
        raise SpecError(flag, f"{path} is neither a regular file nor a folder; give {want} path")
    _check_writable(flag, p if folder and p.is_dir() else parent)
    return p


def _check_writable(flag: str, folder: Path) -> None:
    """A file can be made in `folder` (and is removed again): a read-only or pseudo file system such as
    /proc or /sys refuses it here rather than after the command's work."""
    from service.spec.errors import SpecError

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise SpecError(flag, f"cannot write in {folder}: {err.strerror}") from None
