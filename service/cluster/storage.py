"""Where outputs go: one place that turns the cluster's storage (`SERVICE_STORAGE_PATH`) into folders.

On one machine everything lands under `<repo>/ray_results/`. On a cluster, a job runs in a temporary copy
of the working dir that vanishes with the cluster, so the cluster names its storage in
`SERVICE_STORAGE_PATH`: a shared POSIX folder (NFS, EFS, Lustre), or a URI that pyarrow's file systems
read (`s3://`, `gs://`, `hdfs://`, `abfs://`; `file://` for a local folder, as Ray Train's own
`storage_path` accepts). A local folder is written directly; for a URI, `run` and `search` write into a
local staging folder and copy the finished folder to `<uri>/<kind>/<name>` with
`pyarrow.fs.copy_files`, so every file the memo names is at the printed URI.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from service.spec.errors import SpecError

STORAGE_ENV = "SERVICE_STORAGE_PATH"
# Schemes pyarrow 25's FileSystem.from_uri resolves (pyarrow/_fs.pyx); a scheme it cannot is refused
# before any work, since resolving an s3:// URI already needs the network.
URI_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")


def configured() -> str | None:
    """$SERVICE_STORAGE_PATH, checked (a one-line `SpecError` naming it), or None when unset or empty."""
    value = os.environ.get(STORAGE_ENV, "").strip()
    if not value:
        return None
    check(value)
    return value


def is_uri(value: str) -> bool:
    return "://" in value


def check(value: str) -> None:
    """An absolute folder or a URI of a scheme pyarrow reads; a `SpecError` naming SERVICE_STORAGE_PATH
    otherwise (a relative folder would land in the job's vanishing working dir)."""
    if is_uri(value):
        scheme = urllib.parse.urlparse(value).scheme.lower()
        if scheme not in URI_SCHEMES:
            known = ", ".join(f"{s}://" for s in URI_SCHEMES)
            raise SpecError(STORAGE_ENV, f"{value!r}: scheme {scheme}:// is not one pyarrow reads ({known})")
        return
    if not Path(value).expanduser().is_absolute():
        raise SpecError(
            STORAGE_ENV,
            f"{value!r} is relative; give an absolute folder on shared storage or a URI (s3://...)",
        )


def results_root(repo_results: Path) -> Path:
    """The local folder outputs are written to: $SERVICE_STORAGE_PATH when it is a folder (or a
    `file://` URI), else `repo_results` (also the staging folder for a remote URI)."""
    value = configured()
    if value is None or (is_uri(value) and not value.startswith("file://")):
        return repo_results
    if value.startswith("file://"):
        return Path(urllib.parse.urlparse(value).path)
    return Path(value).expanduser()


def folder_root(repo_results: Path, what: str) -> Path:
    """`results_root` for outputs that must be POSIX files (checkpoints, step logs): a URI is refused in
    one line naming SERVICE_STORAGE_PATH, before anything starts, rather than at the first checkpoint."""
    if remote_root() is not None:
        raise SpecError(
            STORAGE_ENV,
            f"{what} keeps checkpoints on a shared folder (NFS, EFS, Lustre); {configured()!r} is a URI: "
            "mount it (e.g. s3fs, mountpoint-s3) and give the mounted folder",
        )
    return results_root(repo_results)


def remote_root() -> str | None:
    """$SERVICE_STORAGE_PATH when outputs must be copied there after being written locally: a URI other
    than `file://` (which `results_root` writes directly)."""
    value = configured()
    if value is None or not is_uri(value) or value.startswith("file://"):
        return None
    return value.rstrip("/")


def publish(local_folder: Path, kind: str, name: str, root: str | None = None) -> str | None:
    """Copies `local_folder` to `<root>/<kind>/<name>` (root: `remote_root()`); the destination URI, or
    None when there is nothing remote to copy to."""
    root = root if root is not None else remote_root()
    if root is None:
        return None
    import pyarrow.fs as pafs

    destination = f"{root.rstrip('/')}/{kind}/{name}"
    fs, path = pafs.FileSystem.from_uri(destination)
    fs.create_dir(path, recursive=True)
    local = pafs.LocalFileSystem()
    pafs.copy_files(str(local_folder), path, source_filesystem=local, destination_filesystem=fs)
    return destination
