"""Catalog entries by name: the model and GPU files under service/catalog/ (one YAML file per item),
read into spec types.

They are read here, beside `engine.engine_rules` and `params.load_params`, which read the catalog's
engines/ and params/ folders the same way, so that a spec can resolve a catalog name in its validator
without importing the catalog package: layers import downward only (tests/test_layers.py), and the
catalog package re-exports these functions.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from service.spec.errors import SpecError, validate_as
from service.spec.hardware import GPUSpec
from service.spec.model import ModelSpec

CATALOG_DIR = Path(__file__).resolve().parent.parent / "catalog"


def model_names() -> list[str]:
    return sorted(p.stem for p in (CATALOG_DIR / "models").glob("*.yaml"))


def gpu_names() -> list[str]:
    return sorted(p.stem for p in (CATALOG_DIR / "gpus").glob("*.yaml"))


@cache
def load_model(name_or_path: str) -> ModelSpec:
    """A catalog model by name (`llama2-13b`), a YAML file of `ModelSpec` fields by path, or a Hugging
    Face `config.json` (the file, or the folder holding it: service/spec/hf_config.py)."""
    from service.spec.experiment import read_yaml
    from service.spec.hf_config import is_hf_config, load_hf_config

    path = CATALOG_DIR / "models" / f"{name_or_path}.yaml"
    if not path.is_file():
        if is_hf_config(name_or_path):
            return load_hf_config(name_or_path)
        if Path(name_or_path).is_dir():
            raise SpecError(
                "model",
                "a folder without a config.json (a Hugging Face model folder holds one)",
                name_or_path,
            )
        if not name_or_path.endswith((".yaml", ".yml")):
            raise SpecError(
                "model",
                f"unknown model {name_or_path!r}; allowed: {', '.join(model_names())}, a .yaml path "
                "or a Hugging Face config.json",
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

    path = CATALOG_DIR / "gpus" / f"{name}.yaml"
    if not path.is_file():
        raise SpecError("gpu", f"unknown GPU {name!r}; allowed: {', '.join(gpu_names())}")
    data = read_yaml(path)
    return validate_as(GPUSpec, {"name": name, **data}, str(path))
