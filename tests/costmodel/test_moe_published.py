"""benchmarks/published/moe_measurements.yaml: published MoE runs, transcribed, not yet in the fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.catalog import load_model
from service.spec import ClusterSpec, Plan, plan_problem

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "published" / "moe_measurements.yaml"
DATA = yaml.safe_load(PATH.read_text())
ROWS = DATA["measurements"]
MEASURES = {"tokens_per_s_per_gpu", "step_time_s", "tflops_per_gpu", "mfu"}


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_each_row_is_a_whole_layout_with_one_measurement_and_a_source(row):
    assert row["source"] in DATA["sources"] and row["ref"]
    assert row["dp"] * row["tp"] * row["pp"] * row["cp"] == row["num_gpus"]
    assert row["micro_batch"] * row["grad_accum"] * row["dp"] == row["global_batch"]
    assert len(set(row["measured"]) & MEASURES) == 1 and set(row["measured"]) <= MEASURES
    assert (row["dp"] * row["cp"] * row["tp"]) % (row["ep"] * row["expert_tp"]) == 0


CATALOG_ROWS = [r for r in ROWS if "model" in r]
# Layouts `Plan` cannot express, by row: Megatron-Core's custom pipeline layouts put the embedding and
# the loss in chunks of their own, so pp·virtual_stages may exceed the blocks.
LAYOUT_GAPS = {"zoo-qwen3-235b-h100-n256-tp2pp32vp3ep8-a2a": "virtual_stages"}


def _cluster(row: dict) -> ClusterSpec | None:
    """The row's cluster; None where the GPUs are not whole nodes (256 GPUs of NVL72 racks)."""
    gpn = row["gpus_per_node"]
    if row["num_gpus"] % gpn:
        return None
    return ClusterSpec(gpu=row["gpu"], num_nodes=row["num_gpus"] // gpn, gpus_per_node=gpn)


@pytest.mark.parametrize("row", CATALOG_ROWS, ids=[r["id"] for r in CATALOG_ROWS])
def test_catalog_rows_are_plans_their_engine_runs(row):
    model = load_model(row["model"])
    assert model.moe is not None
    fields = ("dp", "tp", "pp", "cp", "ep", "expert_tp", "virtual_stages", "micro_batch", "grad_accum")
    fields += ("engine", "zero_stage", "recompute", "sequence_parallel")
    plan = Plan.model_construct(**{**Plan().model_dump(), **{f: row[f] for f in fields if f in row}})
    problem = plan_problem(plan, model, _cluster(row))
    assert (problem[0] if problem else None) == LAYOUT_GAPS.get(row["id"]), problem


def test_the_deepseek_v3_check_is_recorded_with_its_numbers():
    check = DATA["named_checks"]["deepseek_v3"]
    text = yaml.safe_dump(check)
    for number in ("2048", "180", "16", "64"):
        assert number in text
