"""What a proxy worker process imports at start-up, and nothing more.

A proxy trial's submit → first step is mostly Python imports in fresh processes (Ray Train starts new
worker actors for every trial); on a 2-core machine every second of import CPU in a worker is about a
second of wall time. `import_deepspeed` drops the one import that buys a proxy worker nothing.
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_deepspeed() -> ModuleType:
    """`import deepspeed`, without DeepSpeed importing MLflow on the way.

    DeepSpeed's autotuner, imported by `deepspeed/__init__.py` through `runtime.config`, does
    `try: import mlflow` (deepspeed/autotuning/autotuner.py, 0.19.x) only to log autotuning
    experiments; with mlflow installed that costs 1.3–1.5 s of a worker's start-up here
    (`python -X importtime`). Proxy workers never log to MLflow (the driver does), so while DeepSpeed is
    imported `import mlflow` fails as if it were absent (a `None` entry in `sys.modules`), then the entry
    is removed so later code in the process could still import it. A process that already has mlflow
    (a driver, a test) is left alone.
    """
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
