"""What a proxy worker process imports at start-up, and nothing more.

A proxy trial's submit → first step is mostly Python imports in fresh processes (Ray Train starts new
worker actors for every trial); on a 2-core machine every second of import CPU in a worker is about a
second of wall time. `import_deepspeed` drops the two imports that buy a proxy worker nothing: MLflow
(while DeepSpeed is imported) and DeepSpeed's Muon optimizer (while its engine is built).
"""

from __future__ import annotations

import sys
from types import ModuleType

MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def _not_loaded(*args: object, **kwargs: object) -> None:
    raise RuntimeError(
        "DeepSpeed's Muon optimizer is not loaded in this worker (a stand-in from service.train.startup); "
        "the service's plans train with Adam"
    )


def stand_in_for_muon() -> None:
    """Put stand-ins for DeepSpeed's two Muon modules in `sys.modules`, unless the real ones are loaded.

    DeepSpeed 0.19's ZeRO and bf16 optimizers import Muon's optimizer class and its update function on
    every engine they build and in every gradient flattening (runtime/zero/stage_1_and_2.py
    `average_tensor`, `_get_flat_partition_unpadded`; stage3.py; bf16_optimizer.py;
    zero/utils.py `is_zero_supported_optimizer`), only to ask `isinstance(optimizer, MuonWithAuxAdam)`
    or whether a tensor has `use_muon` set. Importing `original_muon` runs its
    `deepspeed.runtime.compiler.compile()` decorators, which import torch._dynamo's backends and
    torch._inductor (the code's own comment: "importing Muon compiles its kernels"): about 1.4 s of
    CPU per worker process here (cProfile of one proxy worker). The service's plans train with Adam
    (service/train/ds_config.py), so the answers are always "no". The stand-ins give them without the
    import: a `MuonWithAuxAdam` no optimizer is an instance of, and a `muon_update` that is never
    reached; both raise if anything ever calls them.
    """
    optimizer_module, update_module = MUON_MODULES
    if optimizer_module not in sys.modules:
        module = ModuleType(
            optimizer_module, "Stand-in for DeepSpeed's Muon optimizer (service.train.startup)."
        )
        module.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {"__init__": _not_loaded})  # type: ignore[attr-defined]
        sys.modules[optimizer_module] = module
    if update_module not in sys.modules:
        module = ModuleType(update_module, "Stand-in for DeepSpeed's Muon update (service.train.startup).")
        module.muon_update = _not_loaded  # type: ignore[attr-defined]
        sys.modules[update_module] = module


def import_deepspeed() -> ModuleType:
    """`import deepspeed` for a worker process: without DeepSpeed importing MLflow on the way, and with
    the Muon stand-ins (`stand_in_for_muon`) in place for its engine.

    DeepSpeed's autotuner, imported by `deepspeed/__init__.py` through `runtime.config`, does
    `try: import mlflow` (deepspeed/autotuning/autotuner.py, 0.19.x) only to log autotuning
    experiments; with mlflow installed that costs 1.3–1.5 s of a worker's start-up here
    (`python -X importtime`). Proxy workers never log to MLflow (the driver does), so while DeepSpeed is
    imported `import mlflow` fails as if it were absent (a `None` entry in `sys.modules`), then the entry
    is removed so later code in the process could still import it. A process that already has mlflow
    (a driver, a test) is left alone.
    """
    stand_in_for_muon()
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    block = "mlflow" not in sys.modules
    if block:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # import machinery: "not installed"
    try:
        import deepspeed
    finally:
        if block and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed
