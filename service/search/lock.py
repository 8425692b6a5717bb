"""One driver per output folder: `folder_lock(folder, what)` holds `folder/.service.lock` while a `run` or a
`search` writes there, and refuses a second one in one line.

Two drivers in one folder corrupt each other (the second restores the first's live search, one trial
is driven by both, `result.json` is whichever finished last), so the second is refused with a
`FolderLocked` (a `SpecError`: the CLI prints one line and exits 2) naming the folder and the holder.

The lock is an exclusive `flock` on the lock file, which the kernel drops when its process dies,
however it dies; the file also says who holds it (pid, host, command, since when) for the refusal
and for a reader. A lock file left by a dead driver is stale and taken over: on this host, a file
whose `flock` is free, or whose pid is gone; on another host (a shared file system, where `flock`
may not reach), the refusal says which file to delete once that host's driver is known to be gone.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from service.spec.errors import SpecError

LOCK_FILE = ".service.lock"


class FolderLocked(SpecError):
    """Another driver holds the folder; `holder` is what its lock file says (pid, host, ...)."""

    def __init__(self, folder: Path, what: str, holder: dict[str, Any], hint: str = ""):
        self.folder, self.holder = folder, holder
        since = holder.get("since")
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
        pid, host = holder.get("pid", "?"), holder.get("host", "?")
        who = f"{holder.get('what', 'a driver')} pid {pid} on {host}{when}"
        super().__init__(
            "storage_path",
            f"{folder} is in use by another {what} ({who}); one {what} per folder at a time: wait for it, "
            f"or give another folder{hint}",
        )


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _holder_gone(holder: dict[str, Any]) -> bool:
    """A lock file's holder is gone: nothing written (a lock being released or never written), or a
    pid on this host that no longer runs."""
    if not holder:
        return True
    if holder.get("host") != socket.gethostname():
        return False  # cannot tell from here
    return not pid_alive(int(holder.get("pid", 0) or 0))


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system has no flock."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            return False
        return None  # ENOLCK and the like: the file's contents decide
    return True


def acquire(folder: Path, what: str) -> int:
    """Takes the folder's lock (creating the folder); the open lock file's descriptor, for `release`.
    Raises `FolderLocked` when a live driver holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    for _ in range(20):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            locked = _try_flock(fd)
            holder = _read(path)
            if locked is False:
                raise FolderLocked(folder, what, holder)
            if locked is None and not _holder_gone(holder):
                raise FolderLocked(folder, what, holder)
            if holder and holder.get("host") != socket.gethostname() and not _holder_gone(holder):
                raise FolderLocked(folder, what, holder, f" (if it is gone, delete {path})")
            # The file may have been removed (released) between open and flock: lock the one at `path`.
            if not path.exists() or os.stat(path).st_ino != os.fstat(fd).st_ino:
                os.close(fd)
                continue
        except BaseException:
            os.close(fd)
            raise
        record = {
            "what": what,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        return fd
    raise FolderLocked(folder, what, _read(path))  # the file kept changing under us: someone is there


def release(folder: Path, fd: int) -> None:
    """Removes the lock file (while still holding it, so nobody takes the old one) and closes it."""
    path = folder / LOCK_FILE
    try:
        if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
            path.unlink()
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def folder_lock(folder: str | Path, what: str) -> Iterator[Path]:
    """Holds `folder`'s lock for the block (see the module's docstring); `what` ("run", "search")
    names the driver in the refusal a second one gets."""
    path = Path(folder).resolve()
    fd = acquire(path, what)
    try:
        yield path
    finally:
        release(path, fd)
