"""Names the service makes folders and MLflow experiments of: a run's name, a tracking experiment's."""

from __future__ import annotations

MAX_NAME_LENGTH = 128


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a folder name inside a storage root (None when it can): empty, `.` or
    `..`, a path separator, a control character, or longer than `MAX_NAME_LENGTH`."""
    if not name.strip():
        return "must not be empty; allowed: a plain folder name such as llama2-13b-32xh100"
    if name in (".", "..") or name.startswith("."):
        return f"{name!r} must not start with '.' (no '..'); allowed: a plain folder name"
    if "/" in name or "\\" in name:
        return f"{name!r} holds a path separator; allowed: a plain folder name, no '/' or backslash"
    if not name.isprintable() or name != name.strip():
        return f"{name!r} holds a control character or edge whitespace; allowed: a plain folder name"
    if len(name) > MAX_NAME_LENGTH:
        return f"{len(name)} characters; allowed: at most {MAX_NAME_LENGTH} (a folder name)"
    return None
