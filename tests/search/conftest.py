"""One real search shared by the integration and MLflow-UI tests (it is the expensive part: two proxy
trials of a tiny Llama on a local 2-worker Ray cluster).

The experiment is tiny-cpu with a 2 GiB memory cap per worker, and the space is built so that each
path shows once: micro-batch 1024 is predicted to fit (24 GiB "device") but exceeds the cap for real
(an OOM trial), micro-batch 2 runs, micro-batch 8192 is predicted not to fit (pruned), tp 4 cannot
be laid out on 2 workers (pruned as invalid).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from service.search.result import SearchResult

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def tiny_experiment(tmp: Path, name: str, **proxy: object) -> Path:
    """tiny-cpu.yaml with its MLflow store, pending records and proxy overrides under `tmp`."""
    data = yaml.safe_load((REPO / "experiments" / "tiny-cpu.yaml").read_text())
    data["name"] = name
    data["proxy"].update({"steps": STEPS, "memory_limit_gib": 2, **proxy})
    data["tracking"] = {
        "uri": f"sqlite:///{tmp / 'mlflow.db'}",
        "experiment_name": name,
        "buffer_dir": str(tmp / "pending"),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def write_space(tmp: Path, name: str, params: dict, **search: object) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "params": params, "search": {"steps": STEPS, **search}}))
    return path


@dataclass
class SearchRun:
    result: SearchResult
    experiment_path: Path
    space_path: Path
    tmp: Path

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.tmp / 'mlflow.db'}"


@pytest.fixture(scope="session")
def tiny_search(tmp_path_factory: pytest.TempPathFactory) -> SearchRun:
    from service.search import RunConfig, Search

    tmp = tmp_path_factory.mktemp("tiny-search")
    experiment = tiny_experiment(tmp, "tiny-search")
    space = write_space(
        tmp,
        "oom-and-pruned",
        {"zero_stage": [1], "tp": [1, 4], "micro_batch": [2, 1024, 8192]},
        algorithm="grid",
        trial_timeout_s=300,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the experiment's own store, not the caller's
        result = Search(experiment, space, run_config=RunConfig(storage_path=tmp / "searches")).fit()
    return SearchRun(result, experiment, space, tmp)


@pytest.fixture
def experiment_file(tmp_path: Path):
    """`experiment_file(name, **proxy)`: a tiny-cpu experiment YAML under this test's tmp_path."""
    return lambda name, **proxy: tiny_experiment(tmp_path, name, **proxy)


@pytest.fixture
def space_file(tmp_path: Path):
    """`space_file(name, params, **search)`: a search-space YAML under this test's tmp_path."""
    return lambda name, params, **search: write_space(tmp_path, name, params, **search)
