"""Enumeration and ranking run with NumPy's huge pages off and give NumPy its setting back."""

from __future__ import annotations

import pytest
from numpy._core import multiarray

from service.plans import pages


def test_ordinary_pages_turns_numpys_huge_pages_off_and_restores_the_setting() -> None:
    previous = multiarray._set_madvise_hugepage(True)
    try:
        with pages.ordinary_pages():
            assert multiarray._set_madvise_hugepage(False) is False  # off inside
        assert multiarray._set_madvise_hugepage(True) is True  # restored
        multiarray._set_madvise_hugepage(False)
        with pages.ordinary_pages():
            pass
        assert multiarray._set_madvise_hugepage(False) is False  # a setting already off stays off
    finally:
        multiarray._set_madvise_hugepage(previous)


def test_the_ranking_runs_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.catalog import load_model
    from service.planner import rank_plans
    from service.spec import Budget, ClusterSpec, Workload

    seen: list[bool] = []
    real = multiarray._set_madvise_hugepage

    def spy(value: bool) -> bool:
        seen.append(value)
        return real(value)

    previous = real(True)
    monkeypatch.setattr(multiarray, "_set_madvise_hugepage", spy)
    cluster = ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1, gpus_per_node=8)
    workload = Workload(seq_len=2048, global_batch_sequences=64, tokens_to_train=1e9)
    ranking = rank_plans(load_model("llama2-7b"), cluster, workload, Budget(objective="throughput"))
    assert len(ranking.enumeration.plans) > 0
    assert seen[0] is False and seen.count(False) >= 2  # ranking, and the enumeration inside it
    assert seen[-1] is True and real(previous) is True  # the caller's setting, back
    monkeypatch.setattr(pages, "ENABLED", False)
    seen.clear()
    rank_plans(load_model("llama2-7b"), cluster, workload, Budget(objective="throughput"))
    assert seen == []  # the benchmark's baseline: NumPy's own setting
