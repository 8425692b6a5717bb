"""The committed H200 results (benchmarks/results/, from benchmarks/gpu_profile_and_proxy_check.sh on a
lent GPU) are read back and re-derived here, and the proxy check's flow runs on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.catalog import load_gpu
from service.profile import load_profile
from service.profile.derive import derive_overrides, fused_attention_override

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results"


def test_committed_h200_profile_rederives_its_overrides():
    profile = load_profile(RESULTS / "gpu_profile.yaml")
    assert profile.device.kind == "cuda" and "H200" in profile.device.name
    assert profile.base_gpu == "h200-sxm-141gb" and profile.dtype == "bf16"
    overrides, _ = derive_overrides(
        "cuda",
        profile.dtype,
        load_gpu(profile.base_gpu),
        128,  # llama2-13b's head size
        profile.gemm,
        profile.attention,
        profile.bandwidth,
        profile.launch,
        profile.adam,
    )
    # The committed profile stores the measured fields; derive.py adds SDPA's cuDNN rate beside them.
    base = load_gpu(profile.base_gpu)
    expected = {
        **profile.overrides,
        **fused_attention_override(base, profile.overrides["attention_efficiency"]),
    }
    assert overrides == pytest.approx(expected, rel=1e-6)
    # Physical sanity: sustained bf16 GEMMs below the datasheet peak, HBM near H200's 4.8 TB/s.
    assert 0.5 < overrides["gemm_efficiency_max"] < 0.9
    assert 3000 < overrides["hbm_bandwidth_gb_per_s"] < 4800


def test_committed_catalog_entry_is_the_profile_applied_to_the_h200_entry():
    import yaml

    profile = load_profile(RESULTS / "gpu_profile.yaml")
    entry = yaml.safe_load((RESULTS / "h200-sxm-141gb-profiled.yaml").read_text())
    for field, value in profile.gpu_overrides().items():
        assert entry[field] == pytest.approx(value)
    base = load_gpu("h200-sxm-141gb")
    assert entry["peak_tflops_bf16"] == pytest.approx(base.peak_tflops_bf16)


@pytest.mark.parametrize("name", ["gpu_proxy_check.json", "gpu_proxy_depth.json"])
def test_committed_proxy_checks_hold_their_own_ratios_and_the_memory_goals(name):
    doc = json.loads((RESULTS / name).read_text())
    assert "H200" in doc["gpu"] and doc["model"] == "llama2-13b"
    ran = [r for r in doc["results"] if "measured" in r]
    assert len(ran) == len(doc["results"]) == 5
    for r in ran:
        for key, ratio in r["measured_over_predicted"].items():
            assert ratio == pytest.approx(r["measured"][key] / r["predicted"][key])
        ratios = r["measured_over_predicted"]
        assert abs(ratios["model_state_bytes_per_rank"] - 1) < 0.01  # goal: 1 %
        assert abs(ratios["activation_bytes_per_rank"] - 1) < 0.10  # goal: 10 %


@pytest.mark.slow
def test_proxy_check_flow_runs_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu_proxy_check.py"), "--device", "cpu"]
    cmd += ["--experiment", str(ROOT / "experiments/tiny-cpu.yaml"), "--plans", "2", "--steps", "3"]
    subprocess.run(
        [*cmd, "--out", str(out)], check=True, capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    doc = json.loads(out.read_text())
    assert [r["plan"] for r in doc["results"]] == [
        "dp1-tp1-pp1-z0-mb1-ga2-rc:none",
        "dp1-tp1-pp1-z1-mb1-ga2-rc:sele",
    ]
    for r in doc["results"]:
        assert r["measured"]["tokens_per_s"] > 0 and len(r["losses"]) == 3
        assert abs(r["measured_over_predicted"]["model_state_bytes_per_rank"] - 1) < 0.01
