"""benchmarks/deepseek_v3_check.py: its JSON's arithmetic holds together (not its verdict), and the H800
catalog entry is the H100 SXM with NVLink cut to 400 GB/s both ways."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from service.catalog import load_gpu

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "deepseek_v3_check", ROOT / "benchmarks" / "deepseek_v3_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("dsv3") / "check.json"
    code = _module().main(["--out", str(out)])
    r = json.loads(out.read_text())
    assert code == (0 if r["met"] else 1)
    return r


def test_prediction_arithmetic(result):
    pub, pred = result["published"], result["prediction"]
    assert sum(pred["breakdown_s"].values()) == pytest.approx(pred["step_time_s"], rel=1e-9)
    tokens_per_step = pub["global_batch_sequences"] * pub["seq_len"]
    per_gpu = tokens_per_step / (pred["step_time_s"] * pub["gpus"])
    assert pred["tokens_per_s_per_gpu"] == pytest.approx(per_gpu, rel=1e-9)
    hours = 1e12 / (per_gpu * 3600)
    assert pred["gpu_hours_per_trillion_tokens"] == pytest.approx(hours, rel=1e-9)
    assert pred["error"] == pytest.approx(hours / pub["gpu_hours_per_trillion_tokens"] - 1, rel=1e-9)
    low, high = pred["interval_80"]
    assert low <= hours <= high
    assert pred["covered"] == (low <= pub["gpu_hours_per_trillion_tokens"] <= high)
    assert low == pytest.approx(1e12 / (pred["tokens_per_s_per_gpu_interval_80"][1] * 3600), rel=1e-9)
    # 180K GPU-hours per 1e12 tokens on 2,048 GPUs at 15,360 x 4,096 tokens a step: 19.9 s a step.
    assert pub["implied_step_time_s"] == pytest.approx(19.90656, rel=1e-6)
    assert result["met"] == (abs(pred["error"]) <= 0.15 and pred["covered"])


def test_layout_is_the_reports(result):
    assert result["plan"].startswith("megatron:dp128-tp1-pp16v2-ep64-z1-mb1-ga120-rc:sele")
    assert result["plan"].endswith("-epo-fp8")
    assert result["published"]["gpus"] == 2048 and result["published"]["gpus_per_node"] == 8


def test_the_all_to_all_decomposition_reproduces_the_priced_term(result):
    """The per-micro-batch exchange and compute, overlapped as the plan prices them, give back the
    estimate's ep_comm term (up to the optimizer step inside compute_s)."""
    a2a = result["not_priced"]["ep_all_to_all_as_priced"]
    assert a2a["exposed_per_step_s"] == pytest.approx(
        result["prediction"]["breakdown_s"]["ep_comm"], rel=0.01
    )
    assert a2a["communication_over_computation"] == pytest.approx(a2a["all_to_all_s"] / a2a["compute_s"])
    limited = result["not_priced"]["ep_all_to_all_node_limited_fp8"]
    assert limited["remote_nodes_per_token"] == pytest.approx(3.5)
    assert limited["all_to_all_s"] < a2a["all_to_all_s"]  # at most 4 nodes, FP8 dispatch: fewer IB bytes


def test_what_it_would_take_adds_up(result):
    take, pred = result["what_it_would_take"], result["prediction"]
    changes = take["all_to_all_s"] + take["dualpipe_bubble_s"] + take["mtp_s"]
    assert take["step_time_s_lower"] == pytest.approx(pred["step_time_s"] + changes, rel=1e-9)
    assert take["step_time_s_lower"] < take["step_time_s_upper"]
    for end in ("lower", "upper"):
        ratio = take[f"gpu_hours_per_trillion_tokens_{end}"] / pred["gpu_hours_per_trillion_tokens"]
        assert ratio == pytest.approx(take[f"step_time_s_{end}"] / pred["step_time_s"], rel=1e-9)
    bubble = result["not_priced"]["dualpipe_bubble"]
    assert bubble["dualpipe_s"] == pytest.approx((16 / 2 - 1) * bubble["stage_compute_s"] / 3)
    memory = result["memory"]
    assert memory["fits"] == (memory["priced_gib"]["total"] <= memory["limit_gib"])
    per_micro_batch = memory["priced_gib"]["activations"] / memory["micro_batches_in_flight_priced"]
    assert memory["activations_at_dualpipe_in_flight_gib"] == pytest.approx(17 * per_micro_batch)
    saved = memory["moe_saved_bytes_per_token_per_layer"]
    assert saved["fp8_storage"] < saved["priced"]


def test_h800_is_the_h100_die_with_nvlink_cut():
    h800, h100 = load_gpu("h800-sxm-80gb"), load_gpu("h100-sxm-80gb")
    differ = {"name", "source", "intra_node_bandwidth_gb_per_s", "price_per_gpu_hour_usd"}
    same = set(type(h800).model_fields) - differ
    assert {f: getattr(h800, f) for f in same} == {f: getattr(h100, f) for f in same}
    # The catalog's bandwidths are per direction: 900 GB/s bidirectional is the H100's 450, 400 the H800's.
    assert h100.intra_node_bandwidth_gb_per_s == 900 / 2 and h800.intra_node_bandwidth_gb_per_s == 400 / 2
    assert h800.inter_node_bandwidth_gb_per_s == 50  # one 400 Gb/s CX7 NIC per GPU
