"""A search run as a library call (issue #35): nothing on stdout (no Tune configuration box, no
TensorBoard hint), and while it runs a second driver on its folder is refused."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.search.lock import LOCK_FILE, FolderLocked

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from service.search import RunConfig, Search, SearchConfig
result = Search(sys.argv[1], sys.argv[2], config=SearchConfig(max_trials=1),
                run_config=RunConfig(storage_path=sys.argv[3], name="silent")).fit()
print(repr(result), file=sys.stderr)
"""


@pytest.mark.slow  # one 3-step proxy trial on a local Ray (~40 s on 2 cores)
def test_a_search_prints_nothing_on_stdout_and_holds_its_folder(
    experiment_file, space_file, tmp_path
) -> None:
    from service.search import RunConfig, Search

    experiment = experiment_file("silent", steps=3, warmup_steps=1)
    space = space_file("one", {"micro_batch": [2]}, algorithm="grid", steps=3)
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(experiment), str(space), str(tmp_path / "searches")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    folder = tmp_path / "searches" / "silent"
    deadline = time.monotonic() + 120
    while not (folder / LOCK_FILE).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    second = Search(
        experiment, space, run_config=RunConfig(storage_path=tmp_path / "searches", name="silent")
    )
    with pytest.raises(
        FolderLocked, match=re.escape(f"{folder} is in use by another search (search pid {proc.pid}")
    ):
        second.fit()
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-2000:]
    assert out == "", out
    assert "SearchResult(1 trials (1 ok)" in err and not (folder / LOCK_FILE).exists()
