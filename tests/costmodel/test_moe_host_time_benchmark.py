"""benchmarks/moe_host_time.py times DeepSpeed's MoE layer on the host at several expert counts, and the
DeepSpeed rule's host time per local expert is the one its committed results give."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.spec.engine import engine_rules

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_benchmark_times_every_expert_count(tmp_path):
    out = tmp_path / "moe_host_time.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_host_time.py"), "--repeats", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    passes = {int(k): v for k, v in data["moe_pass_ms"].items()}
    assert sorted(passes) == [4, 8, 16, 32, 64, 128] and data["dense_mlp_pass_ms"] > 0
    # The loop over the local experts: 128 of them cost the host more than 4 (timing shape, not speed).
    assert passes[128] > passes[4] and data["fit_ms"]["per_local_expert"] > 0


def test_the_rule_is_the_measured_slope():
    results = json.loads((ROOT / "benchmarks" / "results" / "moe_host_time.json").read_text())
    measured_s = results["fit_ms"]["per_local_expert"] / 1e3
    rule = engine_rules("deepspeed").expert_parallel.host_s_per_local_expert
    assert rule == pytest.approx(measured_s, rel=0.1)
