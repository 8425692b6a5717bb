"""The shipped MoE search space (search_spaces/qwen3-30b-a3b-64xh100.yaml) prunes against its
experiment as the engine the proxies run allows: DeepSpeed's MoE layer refuses ZeRO-3, so those plans
are pruned with that reason, and the rest (expert-parallel degrees 1-8) are candidates in the model's
order, every one of them a layout DeepSpeed can build (ep divides the 128 experts and the 8 ranks)."""

from __future__ import annotations

from pathlib import Path

from service.search.config import RunConfig
from service.search.driver import Search

REPO = Path(__file__).resolve().parents[2]


def test_the_moe_space_prunes_zero3_and_keeps_every_expert_parallel_degree(tmp_path):
    search = Search(
        REPO / "experiments" / "qwen3-30b-a3b-64xh100.yaml",
        REPO / "search_spaces" / "qwen3-30b-a3b-64xh100.yaml",
        run_config=RunConfig(storage_path=tmp_path),
    )
    pr = search.pruning()
    plans = [c.plan for c in pr.candidates]
    assert {p.ep for p in plans} == {1, 2, 4, 8}
    assert all(p.zero_stage <= 2 and 128 % p.ep == 0 and p.dp % p.ep == 0 for p in plans)
    values = [c.predicted_value for c in pr.candidates]
    assert values == sorted(values, reverse=True)  # best predicted first
    zero3 = [p for p in pr.pruned if p.point.get("zero_stage") == 3]
    assert len(zero3) == 4 * 3 * 3  # ep x micro-batch x recompute, all refused
    assert all("DeepSpeed's MoE layer" in p.reason for p in zero3), {p.reason for p in zero3}
