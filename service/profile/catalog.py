"""A GPU catalog entry from a profile: the base entry's fields with the measured ones laid over them,
each measured line marked, and a header saying where, when and how they were measured."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from service.profile.record import Profile
from service.spec.errors import SpecError
from service.spec.hardware import GPUSpec

CATALOG_GPUS = Path(__file__).resolve().parents[1] / "catalog" / "gpus"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def _scalar(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _base_note(profile: Profile, spec: GPUSpec) -> str:
    """Where the unmeasured fields come from; a base entry that was itself profiled passes its own note
    on rather than nesting one source inside another."""
    marker = "; other fields from "
    if marker in spec.source:
        return spec.source.split(marker, 1)[1]
    return f"catalog entry {profile.base_gpu} ({spec.source or 'no source given'})"


def catalog_entry_yaml(
    profile: Profile, base: GPUSpec | None = None, comments: list[str] | None = None
) -> str:
    """The catalog YAML of `profile.gpu_spec(base)`: every GPUSpec field but `name` (the file's stem)."""
    spec = profile.gpu_spec(base)
    d = profile.device
    measured = set(profile.overrides)
    source = (
        f"speed fields (# measured) by `python -m service profile` on {d.name}, {d.threads} "
        f"{'thread(s)' if d.kind == 'cpu' else 'SMs'}, {d.date[:10]}, torch {d.torch_version}, "
        f"{profile.dtype} {profile.model} shapes, medians; other fields from {_base_note(profile, spec)}"
    )
    lines = [f"# {c}" for c in comments or []] + [f"source: {_scalar(source)}"]
    for field in GPUSpec.model_fields:
        if field in ("name", "source"):
            continue
        value = getattr(spec, field)
        lines.append(f"{field}: {_scalar(value)}" + ("  # measured" if field in measured else ""))
    return "\n".join(lines) + "\n"


def write_catalog_entry(
    profile: Profile,
    name: str,
    directory: str | Path = CATALOG_GPUS,
    base: GPUSpec | None = None,
    comments: list[str] | None = None,
) -> Path:
    """Writes `directory/NAME.yaml` and checks that it loads back as the same GPUSpec."""
    from service.catalog import load_gpu
    from service.spec.errors import validate_as
    from service.spec.experiment import read_yaml

    if not _NAME.match(name):
        raise SpecError(
            "--write-catalog", f"catalog name {name!r}: lower-case letters, digits, '.', '_', '-'"
        )
    path = Path(directory) / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(catalog_entry_yaml(profile, base, comments))
    validate_as(GPUSpec, {"name": name, **read_yaml(path)}, str(path))
    load_gpu.cache_clear()
    return path
