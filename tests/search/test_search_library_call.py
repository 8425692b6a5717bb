"""A search run as a library call, nobody giving it a folder (the shared search,
tests/search/conftest.py::tiny_search, is one).

- Nothing on stdout (no Tune configuration box, no TensorBoard hint; issue #35).
- While it runs, a second driver on its folder is refused.
- Its folder is where the cluster's storage is; when that storage is a URI (`SERVICE_STORAGE_PATH=
  s3://...`), the finished folder is copied there and the result says where.
"""

from __future__ import annotations

import json

import pytest

from service.search.lock import LOCK_FILE, FolderLocked

pytestmark = pytest.mark.slow


def test_a_library_search_prints_nothing(tiny_search) -> None:
    assert tiny_search.stdout == "", tiny_search.stdout
    assert repr(tiny_search.result) in tiny_search.stderr  # what the script printed there


def test_a_second_driver_on_its_folder_is_refused_while_it_runs(tiny_search) -> None:
    err = tiny_search.second_driver
    assert isinstance(err, FolderLocked), repr(err)
    wanted = f"{tiny_search.folder} is in use by another search (search pid {tiny_search.pid}"
    assert wanted in str(err)
    assert not (tiny_search.folder / LOCK_FILE).exists()  # released when the search ended


def test_its_folder_is_the_storage_and_is_copied_to_the_remote_uri(tiny_search) -> None:
    result = tiny_search.result
    assert result.path == str(tiny_search.folder)
    assert result.copied_to == f"file://{tiny_search.bucket}/search/tiny-search"
    copied = tiny_search.bucket / "search" / "tiny-search"
    assert json.loads((copied / "search_state.json").read_text()) == json.loads(
        (tiny_search.folder / "search_state.json").read_text()
    )
    assert sorted(p.name for p in (copied / "proxy_runs").iterdir()) == sorted(
        p.name for p in (tiny_search.folder / "proxy_runs").iterdir()
    )
