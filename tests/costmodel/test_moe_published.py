"""benchmarks/published/moe_measurements.yaml (published MoE runs, a runs file) and moe_unpriced.yaml
(the rows the cost model cannot price yet, each with why)."""

from __future__ import annotations

from pathlib import Path

import yaml

from service.calibrate.runs import load_dataset, load_runs
from service.calibrate.source_flops import megatron_moe_flops_per_token
from service.catalog import load_model

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "published"


def test_every_priced_row_loads_as_a_moe_run_of_its_engine():
    runs = load_runs(HERE / "moe_measurements.yaml")
    assert len(runs) >= 20
    assert all(r.model.moe is not None and r.tokens_per_s_per_gpu for r in runs)
    assert any(r.plan.ep > 1 for r in runs) and any(r.plan.ep_comm_overlap for r in runs)
    balanced = [r for r in runs if r.workload.moe_load_imbalance == 1.0]
    dropping = [r for r in runs if r.model.moe.router == "capacity"]
    assert balanced and dropping


def test_rows_keep_what_the_model_does_not_read_in_details():
    ds = load_dataset(HERE / "moe_measurements.yaml")
    assert all(row.details.get("software") for row in ds.measurements)


def test_megatron_moe_flops_reproduce_the_zoo_conversion():
    """The model zoo's Qwen3-235B row: 19.7 s per 2,048 × 4,096-token step on 256 GPUs is 245 TFLOP/s
    per GPU under Megatron's formula (the zoo prints 245)."""
    tokens_per_s_per_gpu = 2048 * 4096 / (19.7 * 256)
    flops = megatron_moe_flops_per_token(load_model("qwen3-235b-a22b"), 4096)
    assert abs(tokens_per_s_per_gpu * flops / 1e12 - 245) < 3


def test_unpriced_rows_say_why_and_the_deepseek_v3_check_is_recorded():
    data = yaml.safe_load((HERE / "moe_unpriced.yaml").read_text())
    assert data["rows"] and all(r["why"] for r in data["rows"])
    text = yaml.safe_dump(data["named_checks"]["deepseek_v3"])
    for number in ("2048", "180", "16", "64"):
        assert number in text
