"""A search nobody gave a folder keeps its folder where the cluster's storage is; when that storage is a
URI (`SERVICE_STORAGE_PATH=s3://...`), the finished search folder is copied there and the result says
where (a file:// URI stands in for the bucket: pyarrow's copy is the same)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_a_search_is_copied_to_a_remote_storage_uri(tmp_path, experiment_file, space_file, monkeypatch):
    from service.cluster import storage
    from service.search import Search, driver

    monkeypatch.delenv("SERVICE_SEARCH_DIR", raising=False)
    monkeypatch.setattr(driver, "results_root", lambda repo_results: tmp_path / "staging")
    monkeypatch.setattr(storage, "remote_root", lambda: f"file://{tmp_path}/bucket")
    experiment = experiment_file("stored", steps=3)
    space = space_file("one", {"zero_stage": [0], "micro_batch": [2]}, asha=None, steps=3)
    result = Search(experiment, space).fit()

    assert [t.status for t in result.trials] == ["ok"]
    name = result.path.rsplit("/", 1)[-1]
    assert result.path == str(tmp_path / "staging" / "search" / name)
    assert result.copied_to == f"file://{tmp_path}/bucket/search/{name}"
    copied = tmp_path / "bucket" / "search" / name
    assert json.loads((copied / "search_state.json").read_text()) == json.loads(
        (tmp_path / "staging" / "search" / name / "search_state.json").read_text()
    )
    assert result.to_dict()["copied_to"] == result.copied_to
