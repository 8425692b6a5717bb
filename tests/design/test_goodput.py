"""The interruption rate's default by cluster size (a small or rented cluster's vs Llama 3's fleet), the
experiment's override, and the cost of checkpointing more often than Young/Daly's optimum."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from service.costmodel.goodput import wall_hours
from service.design.goodput import goodput_record, interval_costs
from service.report.decision_records import Goodput
from service.report.memo_goodput import goodput_blocks
from service.report.result import RunResult
from service.spec import load_experiment
from service.spec.production import GoodputSpec

SEED = Path(__file__).resolve().parents[2] / "experiments" / "llama2-13b-32xh100.yaml"


def test_default_rate_depends_on_the_cluster_size() -> None:
    spec = GoodputSpec()
    # Kokolis et al. 2024: 8-GPU jobs fail every 47.7 days on Meta's research clusters.
    assert spec.rate_per_gpu_hour(32) == pytest.approx(1 / (47.7 * 24 * 8))
    assert spec.rate_per_gpu_hour(32) == pytest.approx(1.092e-4, rel=1e-3)
    small = spec.source_for(32)
    assert "Kokolis" in small and "47.7 days" in small and "32" in small
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs.
    assert spec.rate_per_gpu_hour(16_384) == pytest.approx(419 / (54 * 24 * 16_384))
    assert spec.rate_per_gpu_hour(16_384) == pytest.approx(1.973e-5, rel=1e-3)
    assert "419 unexpected interruptions" in spec.source_for(16_384)
    # The boundary: the largest job size Kokolis et al. measured (1,024 GPUs, 7.9 h).
    assert spec.rate_per_gpu_hour(1024) == spec.rate_per_gpu_hour(8)
    assert spec.rate_per_gpu_hour(1025) == spec.rate_per_gpu_hour(16_384)
    # The seed experiment (32 H100s, no goodput section) gets the small cluster's rate.
    seed = load_experiment(SEED)
    assert seed.goodput.interruptions_per_gpu_hour is None
    assert seed.goodput.rate_per_gpu_hour(seed.cluster.num_gpus) == spec.rate_per_gpu_hour(32)


def test_the_experiment_sets_the_rate_for_every_size() -> None:
    own = GoodputSpec(interruptions_per_gpu_hour=5e-5)
    assert own.rate_per_gpu_hour(32) == own.rate_per_gpu_hour(16_384) == 5e-5
    assert own.source_for(32) == "the experiment's goodput.interruptions_per_gpu_hour"
    cited = GoodputSpec(interruptions_per_gpu_hour=5e-5, interruption_source="our cluster, 2025")
    assert cited.source_for(32) == "our cluster, 2025"
    # A source without a rate does not relabel the default rate.
    assert "Kokolis" in GoodputSpec(interruption_source="ours").source_for(32)
    g = goodput_record(10.0, 32, 36e9, own)
    assert g.interruptions_per_gpu_hour == 5e-5 and g.mtbf_hours == pytest.approx(1 / (5e-5 * 32))
    assert g.interruption_source == own.source_for(32) and g.num_gpus == 32
    none = GoodputSpec(interruptions_per_gpu_hour=0.0)
    assert wall_hours(np.array([5.0]), 32, 36e9, none)[0] == 5.0
    with pytest.raises(ValueError):
        GoodputSpec(interruptions_per_gpu_hour=-1.0)


def test_cost_of_checkpointing_more_often_by_hand() -> None:
    # C = 36 GB / 1 GB/s = 36 s = 0.01 h; M = 1 / (λ·N) = 32 h; R = 6 min = 0.1 h; H = 10 h.
    # Young/Daly: τ = sqrt(2 · 0.01 · 32) = 0.8 h.
    spec = GoodputSpec(interruptions_per_gpu_hour=1 / 1024, storage_bandwidth_gb_per_s=1.0, restart_minutes=6)
    rows = interval_costs(10.0, 32, 36e9, spec)
    assert [r.label for r in rows] == ["Young/Daly optimum", "1 h", "30 min", "15 min"]
    assert [r.interval_hours for r in rows] == pytest.approx([0.8, 1.0, 0.5, 0.25])
    # W = H·(1 + C/τ + (τ/2 + R + C)/M):
    #   0.8 h: 10·(1 + 0.0125 + 0.51/32)   = 10.284375
    #   1 h:   10·(1 + 0.01   + 0.61/32)   = 10.290625
    #   30 min: 10·(1 + 0.02  + 0.36/32)   = 10.3125
    #   15 min: 10·(1 + 0.04  + 0.235/32)  = 10.4734375
    assert [r.wall_hours for r in rows] == pytest.approx([10.284375, 10.290625, 10.3125, 10.4734375])
    assert [r.extra_vs_optimum for r in rows] == pytest.approx(
        [0.0, 10.290625 / 10.284375 - 1, 10.3125 / 10.284375 - 1, 10.4734375 / 10.284375 - 1]
    )
    assert all(r.extra_vs_optimum > 0 for r in rows[1:])  # the optimum is the minimum
    g = goodput_record(10.0, 32, 36e9, spec)
    assert g.interval_costs == rows and g.failure_free_hours == 10.0
    assert 10.0 / g.goodput == pytest.approx(10.284375)  # the same rule as the record's goodput


def test_only_intervals_shorter_than_the_run() -> None:
    spec = GoodputSpec(interruptions_per_gpu_hour=1 / 1024, storage_bandwidth_gb_per_s=1.0, restart_minutes=6)
    rows = interval_costs(0.4, 32, 36e9, spec)  # shorter than Young's 0.8 h: the run's end only
    assert [r.interval_hours for r in rows] == pytest.approx([0.4, 0.25])
    assert rows[0].label.startswith("the run's end only")
    # 0.4·(1 + 0.04 + 0.235/32) against 0.4·(1 + 0.025 + 0.31/32)
    assert rows[1].extra_vs_optimum == pytest.approx((1.04 + 0.235 / 32) / (1.025 + 0.31 / 32) - 1)
    assert len(interval_costs(0.2, 32, 36e9, spec)) == 1  # nothing shorter than the run


def test_memo_shows_the_interval_the_rate_with_its_source_and_the_table() -> None:
    g = goodput_record(10.0, 32, 36e9, GoodputSpec(storage_bandwidth_gb_per_s=1.0))
    blocks = goodput_blocks(_result(g.model_dump(mode="json")))
    text = " ".join(b[1] for b in blocks if b[0] == "p")
    assert f"Checkpoint every **{g.checkpoint_interval_hours:.2f} h**" in text
    assert f"{g.interruptions_per_gpu_hour:.3g} per GPU-hour on 32 GPUs" in text
    assert "its source: the Goodput table below" in text and "Kokolis" not in text  # said once, there
    tables = [b for b in blocks if b[0] == "table"]
    assert len(tables) == 1
    rows = tables[0][2]
    assert [row[0] for row in rows][1:] == [c.label for c in g.interval_costs][1:]
    assert rows[0][2] == "—" and rows[-1][2] == f"+{g.interval_costs[-1].extra_vs_optimum:.2%}"


def test_a_result_written_before_the_table_still_loads_and_renders(tmp_path: Path) -> None:
    new = goodput_record(10.0, 32, 36e9, GoodputSpec()).model_dump(mode="json")
    old = {k: v for k, v in new.items() if k not in ("num_gpus", "failure_free_hours", "interval_costs")}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(_result(old).to_json()))
    loaded = RunResult.load(path)
    assert isinstance(loaded.goodput, Goodput) and loaded.goodput.interval_costs == []
    blocks = goodput_blocks(loaded)
    assert [b[0] for b in blocks] == ["p", "p"]  # no table without the new fields
    assert " on 0 GPUs" not in blocks[1][1]


def _result(goodput: dict[str, object]) -> RunResult:
    return RunResult.model_validate(
        {
            "experiment": "x",
            "objective": "cost",
            "budget": {},
            "cluster": {
                "gpu": "h100-sxm-80gb",
                "num_nodes": 4,
                "gpus_per_node": 8,
                "num_gpus": 32,
                "price_per_gpu_hour_usd": 2.5,
                "hbm_gib": 80,
            },
            "created": "now",
            "selected_plan": None,
            "selected_label": None,
            "predicted": None,
            "message": "",
            "goodput": goodput,
        }
    )
