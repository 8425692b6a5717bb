"""One driver per output folder (issue #35): a second `run` or `search` in a folder another process is
using is refused in one line naming the folder and the holder; a lock left by a dead driver is taken
over. No Ray here: the lock is taken before anything else."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from service.search.lock import LOCK_FILE, FolderLocked, folder_lock
from service.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time; from service.search.lock import folder_lock\n"
    "with folder_lock(sys.argv[1], sys.argv[2]):\n"
    "    print('held', flush=True); time.sleep(120)\n"
)


def hold(folder: Path, what: str = "run") -> subprocess.Popen[str]:
    """Another process holding `folder`'s lock (until it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder), what], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_the_lock_is_released_on_exit_and_refuses_a_second_holder(tmp_path: Path) -> None:
    with folder_lock(tmp_path / "out", "run"):
        holder = json.loads((tmp_path / "out" / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(FolderLocked) as info, folder_lock(tmp_path / "out", "run"):
            pass  # pragma: no cover
    assert not (tmp_path / "out" / LOCK_FILE).exists()
    message = str(info.value)
    assert isinstance(info.value, SpecError) and "\n" not in message
    assert str(tmp_path / "out") in message and f"pid {os.getpid()}" in message
    with folder_lock(tmp_path / "out", "run"):  # free again
        pass


def test_a_live_holder_refuses_and_a_killed_one_leaves_a_stale_lock(tmp_path: Path) -> None:
    proc = hold(tmp_path)
    try:
        refused = pytest.raises(
            FolderLocked, match=re.escape(f"run pid {proc.pid} on {socket.gethostname()}")
        )
        with refused, folder_lock(tmp_path, "run"):
            pass  # pragma: no cover
    finally:
        proc.kill()
        proc.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid  # left behind: stale
    with folder_lock(tmp_path, "run"):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_dead_pid_is_stale_and_another_host_is_not_guessed(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(done.stdout)
    (tmp_path / LOCK_FILE).write_text(json.dumps({"what": "run", "pid": dead, "host": socket.gethostname()}))
    with folder_lock(tmp_path, "run"):
        pass
    (tmp_path / LOCK_FILE).write_text(json.dumps({"what": "search", "pid": 1, "host": "elsewhere-7"}))
    refused = pytest.raises(
        FolderLocked, match=r"search pid 1 on elsewhere-7.*delete " + re.escape(str(tmp_path))
    )
    with refused, folder_lock(tmp_path, "run"):
        pass  # pragma: no cover


def test_search_fit_is_refused_before_it_writes_anything(tmp_path: Path) -> None:
    from service import Search, SearchSpace
    from service.search import RunConfig

    search = Search(
        REPO / "experiments" / "tiny-cpu.yaml",
        SearchSpace(params={"micro_batch": [2]}),
        run_config=RunConfig(storage_path=tmp_path, name="s"),
    )
    proc = hold(search.path, "search")
    try:
        with pytest.raises(FolderLocked, match=re.escape(f"{search.path} is in use by another search")):
            search.fit()
    finally:
        proc.kill()
        proc.wait()
    assert sorted(p.name for p in search.path.iterdir()) == [LOCK_FILE]  # no state written


def test_run_is_refused_in_one_line_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli.main import main

    out = tmp_path / "out"
    proc = hold(out)
    try:
        code = main(["run", str(REPO / "experiments" / "tiny-cpu.yaml"), "--no-proxies", "--out", str(out)])
    finally:
        proc.kill()
        proc.wait()
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert f"{out} is in use by another run (run pid {proc.pid}" in err
    assert not (out / "result.json").exists()
