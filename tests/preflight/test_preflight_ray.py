"""`python -m service preflight` on a local Ray (2 CPU workers, gloo), the tiny experiment's selected plan:
a few production steps, the plan's collectives and a checkpoint load and save, with one threshold set
impossibly high: NO-GO naming it, exit 1, one JSON document on stdout; with `--compare tie`, the A/B of
the choice and the best plan on paper among its ties; the measured runs it wrote (both plans) load as a
runs file and `calibrate` fits on them.

One Ray run (three Ray Train jobs: the production steps, the probe, the A/B's other plan); its own
local Ray (RAY_ADDRESS dropped), as tests/cluster/test_production.py runs `service train`. In the
"trials" stream (tests/conftest.py, by path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_preflight_measures_the_plan_and_says_no_go_for_an_impossible_threshold(tmp_path: Path):
    from service.calibrate.runs import load_runs
    from service.cli.main import main

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "service", "preflight", "experiments/tiny-cpu.yaml", "--steps", "4",
           "--out", str(out), "--storage-path", str(tmp_path / "storage"), "--no-track", "--json",
           "--min-tokens-per-s", "1e12", "--compare", "tie"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 1, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # exactly one JSON document (Ray's output went to stderr)
    assert doc["go"] is False and doc["verdict"].startswith("NO-GO: tokens/s ")
    assert doc["reasons"][0].endswith("< 1,000,000,000,000")
    assert "thresholds (stated before measuring)" in proc.stderr

    production = doc["production"]
    assert production["status"] == "ok" and production["steps"] == 4
    assert production["tokens_per_s"] > 0 and production["step_time_s"] > 0
    assert 0 < production["peak_memory_bytes"] < 4 * 2**30
    assert len(production["peak_memory_bytes_by_rank"]) == 2
    # pp2 ZeRO-0: the loss all-reduce and the stages' send/receive, inside the one node
    measured = {(c["op"], c["scope"]) for c in doc["collectives"]}
    assert measured == {("all_reduce", "intra_node"), ("send_recv", "intra_node")}
    for c in doc["collectives"]:
        assert c["group_size"] == 2 and c["bus_gb_per_s"] > 0 and c["assumed_bus_gb_per_s"] > 0
    ckpt = doc["checkpoint"]
    assert "error" not in ckpt, ckpt
    assert ckpt["loaded_from"] and ckpt["saved_step"] == 4  # the production run's final checkpoint
    assert ckpt["save_s"] > 0 and ckpt["load_s"] > 0 and ckpt["bytes"] > 1e6 and ckpt["write_gb_per_s"] > 0
    assert not [p for p in (tmp_path / "storage").rglob("checkpoint_*") if p.is_dir()]  # removed once timed

    ab = doc["ab"]  # the A/B informs; the verdict above is the chosen plan's alone
    assert ab["chosen"] == doc["plan"] and ab["other"] != doc["plan"] and ab["other_status"] == "ok"
    assert ab["chosen_tokens_per_s"] == production["tokens_per_s"] and ab["other_tokens_per_s"] > 0
    assert ab["other_over_chosen"] == pytest.approx(ab["other_tokens_per_s"] / ab["chosen_tokens_per_s"])
    assert ab["line"].startswith("A/B: ") and "faster than" in ab["line"]

    runs_file = Path(doc["runs_file"])
    assert runs_file == out / "preflight_run.yaml" and (out / "preflight.json").is_file()
    run, other = load_runs(runs_file)
    assert run.plan.short() == doc["plan"] and other.plan.short() == ab["other"]
    assert run.tokens_per_s_per_gpu == pytest.approx(production["tokens_per_s"] / 2)
    assert other.tokens_per_s_per_gpu == pytest.approx(ab["other_tokens_per_s"] / 2)
    assert main(["calibrate", str(runs_file), "--no-crossval", "--json"]) == 0
