"""One error type for bad input, and the one-line message every entry point prints for it.

A user who typed a wrong key or an impossible plan wants one line that names the file, the field and
what is allowed, never a traceback. Everything that reads user input raises `SpecError`; the CLI
prints `str(err)` and exits 2.
"""

from __future__ import annotations

import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class SpecError(ValueError):
    """Bad user input: `field` is a dotted path, `source` the file (or flag) it came from."""

    def __init__(self, field: str, message: str, source: str | None = None):
        # One line whatever the input held: a newline in a name or a library's message would split it.
        self.field = one_line(field)
        self.message = one_line(message)
        self.source = one_line(source) if source else None
        where = f"{self.source}: " if self.source else ""
        super().__init__(f"{where}{self.field}: {self.message}")


def one_line(text: str) -> str:
    """`text` with its line breaks and other control characters shown as spaces (runs collapsed)."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())


def _allowed_keys(model_cls: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str] | None:
    """Walks `loc` through nested pydantic models to list the keys allowed where the bad key sits."""
    cls = model_cls
    for part in loc[:-1]:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        cls = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return sorted(cls.model_fields) if cls is not None else None


def from_validation_error(
    err: ValidationError, source: str | None = None, model_cls: type[BaseModel] | None = None
) -> SpecError:
    """Turns pydantic's multi-line report into a `SpecError` about its first problem."""
    errors = err.errors(include_url=False)
    # An unknown key first: a misspelt key also shows up as a missing field, and the key is the cause.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(p for p in first["loc"] if p not in ("function-after", "function-before"))
    field = ".".join(str(p) for p in loc) or "(top level)"
    msg = str(first["msg"]).removeprefix("Value error, ")
    inner = (first.get("ctx") or {}).get("error")
    if isinstance(inner, SpecError):
        if inner.source:  # the problem sits in another file (a model YAML the experiment names)
            return inner
        msg = inner.message  # a catalog lookup inside a validator already said what is allowed
        if not loc or loc[-1] != inner.field:  # a model validator naming the field at fault
            field = ".".join([*(str(p) for p in loc), inner.field])
    if first["type"] == "extra_forbidden":
        allowed = _allowed_keys(model_cls, loc)
        msg = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
    return SpecError(field, msg, source)


def _kinds(annotation: Any) -> tuple[Any, ...]:
    """The types an annotation admits: `int | None` → (int, NoneType); list[X] → (list, X)."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return tuple(k for a in get_args(annotation) for k in _kinds(a))
    if origin in (list, tuple, set, frozenset):
        return (origin, *(k for a in get_args(annotation) for k in _kinds(a)))
    return (annotation,)


def bool_given_for_number(model_cls: type[BaseModel], data: Any) -> str | None:
    """The dotted path of the first `true`/`false` given where `model_cls` wants a number, else None.

    pydantic's lax mode reads a boolean as 1 or 0 in an int or float field, so `num_nodes: true` in a
    YAML file would plan for one node without a word; user input is checked for it before validation."""
    if not isinstance(data, dict):
        return None
    for key, value in data.items():
        field = model_cls.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue
        kinds = _kinds(field.annotation)
        numeric = bool not in kinds and any(k in (int, float) for k in kinds)
        if numeric and isinstance(value, bool):
            return key
        if numeric and list in kinds and isinstance(value, list):  # a list of numbers, e.g. tp: [1, true]
            at = next((i for i, item in enumerate(value) if isinstance(item, bool)), None)
            if at is not None:
                return f"{key}.{at}"
        nested = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if nested is None:
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            inner = bool_given_for_number(nested, item)
            if inner is not None:
                return ".".join(str(p) for p in (key, i, inner) if p is not None)
    return None


def validate_as(model_cls: type[M], data: Any, source: str | None = None, prefix: str = "") -> M:
    """`model_cls.model_validate(data)`, with errors as a one-line `SpecError`; a boolean where a
    number belongs is one of them (`bool_given_for_number`)."""
    where = bool_given_for_number(model_cls, data)
    if where is not None:
        field = f"{prefix}.{where}" if prefix else where
        raise SpecError(field, "expected a number, got true/false", source)
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        spec_err = from_validation_error(err, source, model_cls)
        if prefix:
            spec_err = SpecError(f"{prefix}.{spec_err.field}", spec_err.message, source)
        raise spec_err from None
