"""A search run as a library call, nobody giving it a folder: one search shows each of these.

- Nothing on stdout (no Tune configuration box, no TensorBoard hint; issue #35).
- While it runs, a second driver on its folder is refused.
- Its folder is where the cluster's storage is; when that storage is a URI (`SERVICE_STORAGE_PATH=
  s3://...`), the finished folder is copied there and the result says where. A file:// URI stands in
  for the bucket (pyarrow's copy is the same), set in the search's own process by patching
  `storage.remote_root` (a real file:// value is written in place, not copied).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.search.lock import LOCK_FILE, FolderLocked

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, pathlib, sys
from service.cluster import storage
from service.search import RunConfig, Search, SearchConfig, driver
experiment, space, staging, bucket = sys.argv[1:]
driver.results_root = lambda repo_results: pathlib.Path(staging)
storage.remote_root = lambda: bucket
config, run_config = SearchConfig(max_trials=1), RunConfig(name="silent")
result = Search(experiment, space, config=config, run_config=run_config).fit()
print(repr(result), file=sys.stderr)
print("RESULT " + json.dumps(result.to_dict()), file=sys.stderr)
"""


@pytest.mark.slow  # one 3-step proxy trial on a local Ray (~40 s on 2 cores)
def test_a_search_prints_nothing_holds_its_folder_and_is_copied_to_remote_storage(
    experiment_file, space_file, tmp_path
) -> None:
    from service.search import RunConfig, Search

    experiment = experiment_file("silent", steps=3, warmup_steps=1)
    space = space_file("one", {"zero_stage": [0], "micro_batch": [2]}, algorithm="grid", asha=None, steps=3)
    staging, bucket = tmp_path / "staging", f"file://{tmp_path}/bucket"
    env = {k: v for k, v in os.environ.items() if k != "SERVICE_SEARCH_DIR"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(experiment), str(space), str(staging), bucket],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    folder = staging / "search" / "silent"
    deadline = time.monotonic() + 120
    while not (folder / LOCK_FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    second = Search(experiment, space, run_config=RunConfig(storage_path=staging / "search", name="silent"))
    with pytest.raises(
        FolderLocked, match=re.escape(f"{folder} is in use by another search (search pid {proc.pid}")
    ):
        second.fit()
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-2000:]
    assert out == "", out
    assert "SearchResult(1 trials (1 ok)" in err and not (folder / LOCK_FILE).exists()

    printed = next(line for line in err.splitlines() if line.startswith("RESULT "))
    result = json.loads(printed.removeprefix("RESULT "))
    assert [t["status"] for t in result["trials"]] == ["ok"]
    assert result["path"] == str(folder)
    assert result["copied_to"] == f"{bucket}/search/silent"
    copied = tmp_path / "bucket" / "search" / "silent"
    assert json.loads((copied / "search_state.json").read_text()) == json.loads(
        (folder / "search_state.json").read_text()
    )
