"""Model and GPU catalogs: one YAML file per item under `models/` and `gpus/`."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from service.spec.errors import SpecError, validate_as
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec

_HERE = Path(__file__).parent


def model_names() -> list[str]:
    return sorted(p.stem for p in (_HERE / "models").glob("*.yaml"))


def gpu_names() -> list[str]:
    return sorted(p.stem for p in (_HERE / "gpus").glob("*.yaml"))


@cache
def load_model(name_or_path: str) -> ModelSpec:
    """A catalog model by name (`llama2-13b`), or a YAML file of `ModelSpec` fields by path."""
    from service.spec.experiment import read_yaml

    path = _HERE / "models" / f"{name_or_path}.yaml"
    if not path.is_file():
        if not name_or_path.endswith((".yaml", ".yml")):
            raise SpecError(
                "model",
                f"unknown model {name_or_path!r}; allowed: {', '.join(model_names())} or a .yaml path",
            )
        path = Path(name_or_path)
    data = read_yaml(path)
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    return validate_as(ModelSpec, data, str(path))


@cache
def load_gpu(name: str) -> GPUSpec:
    """A catalog GPU by name (`h100-sxm-80gb`)."""
    from service.spec.experiment import read_yaml

    path = _HERE / "gpus" / f"{name}.yaml"
    if not path.is_file():
        raise SpecError("gpu", f"unknown GPU {name!r}; allowed: {', '.join(gpu_names())}")
    data = read_yaml(path)
    return validate_as(GPUSpec, {"name": name, **data}, str(path))
