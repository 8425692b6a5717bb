"""One real search shared by the integration, library-call, unschedulable, MLflow-UI and `search --resume`
tests (it is the expensive part: three proxy trials of a tiny Llama on a local 2-worker Ray cluster),
each test checking a different thing of the same run.

The experiment is tiny-cpu with a 2 GiB memory cap per worker, and the space is built so that each
path shows once: micro-batch 1024 is predicted to fit (24 GiB "device") but exceeds the cap for real
(an OOM trial), micro-batch 4 asks for a resource no node has (unschedulable after the pending
timeout), micro-batch 2 runs, micro-batch 8192 is predicted not to fit (pruned), tp 4 cannot be laid
out on 2 workers (pruned as invalid).

It runs as a library call in its own process, nobody giving it a folder (`SEARCH_SCRIPT`): its stdout
must stay empty, its folder is where the cluster's storage is, and that storage is a URI, so the
finished folder is copied there (a file:// URI stands in for the bucket, set in the search's process by
patching `storage.remote_root`: a real file:// value is written in place, not copied). While it runs,
this process tries a second driver on the same folder, which must be refused. Its local Ray offers
two trials' worth of logical CPUs, so the unschedulable trial waits out its pending timeout beside the
others (it holds no CPU while it waits) instead of after them.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
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


# Every trial's workers must be placed within it. A controller alone takes 5-7 s to start; on a loaded
# 2-core machine (both test streams plus other work) a runnable trial once took over 30 s and was judged
# unschedulable, so the margin is wide.
PENDING_S = 45
SEARCH_SCRIPT = """
import pathlib, pickle, sys
from service.cluster import storage
from service.search import RunConfig, Search, SearchConfig, driver
experiment, space, staging, bucket, out, pending_s = sys.argv[1:]
driver.results_root = lambda repo_results: pathlib.Path(staging)
storage.remote_root = lambda: bucket
driver.driver_cpus = lambda world_size: 2 * world_size + 1  # two trials side by side
config = SearchConfig(pending_timeout_s=float(pending_s), trial_timeout_s=300)
result = Search(experiment, space, config=config, run_config=RunConfig(name="tiny-search")).fit()
pathlib.Path(out).write_bytes(pickle.dumps(result))
print(repr(result), file=sys.stderr)
"""


@dataclass
class SearchRun:
    result: SearchResult
    experiment_path: Path
    space_path: Path
    tmp: Path
    stuck_key: str  # the plan whose workers asked for a resource no node has
    stdout: str  # the search process's
    stderr: str
    pid: int
    second_driver: BaseException | None  # what a second driver on the same folder got while it ran
    bucket: Path  # where the file:// "remote storage" is

    @property
    def uri(self) -> str:
        return f"sqlite:///{self.tmp / 'mlflow.db'}"

    @property
    def folder(self) -> Path:
        return self.tmp / "staging" / "search" / "tiny-search"


@pytest.fixture(scope="session")
def tiny_search(tmp_path_factory: pytest.TempPathFactory) -> SearchRun:
    from service.search import RunConfig, Search
    from service.search.lock import LOCK_FILE
    from service.search.prune import prune_space
    from service.search.space import load_space
    from service.search.tuning import RESOURCES_ENV
    from service.spec.experiment import load_experiment

    tmp = tmp_path_factory.mktemp("tiny-search")
    experiment = tiny_experiment(tmp, "tiny-search")
    space = write_space(
        tmp,
        "oom-and-pruned",
        {"zero_stage": [1], "tp": [1, 4], "micro_batch": [2, 4, 1024, 8192]},
        algorithm="grid",
        asha=None,
    )
    candidates = prune_space(load_experiment(experiment), load_space(space)).candidates
    stuck = next(c.key for c in candidates if c.plan.micro_batch == 4)
    env = {k: v for k, v in os.environ.items() if k not in ("SERVICE_SEARCH_DIR", "MLFLOW_TRACKING_URI")}
    env[RESOURCES_ENV] = json.dumps({"plan": stuck, "resources": {"unobtainium": 1}})
    staging, bucket, out = tmp / "staging", tmp / "bucket", tmp / "result.pkl"
    args = [str(experiment), str(space), str(staging), f"file://{bucket}", str(out), str(PENDING_S)]
    proc = subprocess.Popen(
        [sys.executable, "-c", SEARCH_SCRIPT, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    folder = staging / "search" / "tiny-search"
    deadline = time.monotonic() + 120
    while not (folder / LOCK_FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    second: BaseException | None = None
    try:
        Search(experiment, space, run_config=RunConfig(storage_path=folder.parent, name="tiny-search")).fit()
    except Exception as err:  # what it raised is the test's to check
        second = err
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stderr[-3000:]
    result = pickle.loads(out.read_bytes())
    return SearchRun(result, experiment, space, tmp, stuck, stdout, stderr, proc.pid, second, bucket)


@pytest.fixture
def experiment_file(tmp_path: Path):
    """`experiment_file(name, **proxy)`: a tiny-cpu experiment YAML under this test's tmp_path."""
    return lambda name, **proxy: tiny_experiment(tmp_path, name, **proxy)


@pytest.fixture
def space_file(tmp_path: Path):
    """`space_file(name, params, **search)`: a search-space YAML under this test's tmp_path."""
    return lambda name, params, **search: write_space(tmp_path, name, params, **search)
