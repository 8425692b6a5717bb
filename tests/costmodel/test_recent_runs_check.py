"""benchmarks/recent_runs_check.py prices every row of both out-of-fit runs files and summarises the bias
per source and per GPU type, the kernel-bound rows (<= 8K tokens, no offload) apart."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import yaml

from service.calibrate.runs import load_dataset, measured_run
from service.costmodel import estimate

ROOT = Path(__file__).resolve().parents[2]


def _module():
    path = ROOT / "benchmarks" / "recent_runs_check.py"
    spec = importlib.util.spec_from_file_location("recent_runs_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_row_of_both_files_is_priced_and_summarised(tmp_path):
    bench = _module()
    out = tmp_path / "recent.json"
    checks = tmp_path / "recent_runs.yaml"
    assert bench.main(["--out", str(out), "--checks", str(checks)]) == 0
    # the memo's evidence reads the shipped copy of what this writes: it is current
    shipped = ROOT / "service" / "catalog" / "checks" / "recent_runs.yaml"
    assert yaml.safe_load(checks.read_text()) == yaml.safe_load(shipped.read_text())
    result = json.loads(out.read_text())
    ids = {m["id"] for path in bench.DATA_PATHS for m in yaml.safe_load(path.read_text())["measurements"]}
    assert {r["id"] for r in result["rows"]} | set(result["unpriced"]) == ids
    assert {r["data"] for r in result["rows"]} == {"deepspeed_recent.yaml", "hopper_recent.yaml"}
    for r in result["rows"]:
        ratio = r["predicted_tokens_per_s_per_gpu"] / r["measured_tokens_per_s_per_gpu"]
        assert abs(r["error"] - (ratio - 1)) < 1e-3

    h200 = [r for r in result["rows"] if r["gpu"] == "h200-sxm-141gb"]
    short = [r for r in h200 if r["seq_len"] <= 8192 and "-offopt" not in r["label"]]
    assert len(short) == result["gpus_short_no_offload"]["h200-sxm-141gb"]["runs"] >= 3
    bias = sum(math.log1p(r["error"]) for r in short) / len(short)
    assert result["gpus_short_no_offload"]["h200-sxm-141gb"]["mean_log_bias"] == round(bias, 4)
    assert result["gpus"]["h200-sxm-141gb"]["runs"] == len(h200) > len(short)


def test_compiled_rows_are_priced_with_fused_elementwise_kernels():
    """torch.compile is read as fused element-wise kernels: the same plan eager is slower, by the
    element-wise traffic alone."""
    bench = _module()
    ds = load_dataset(bench.DATA_PATHS[1])
    row = next(m for m in ds.measurements if m.id == "titan-h100-llama3-8b-n8-compile")
    run = measured_run(ds, row)
    assert run.workload.fused_elementwise
    compiled = estimate(run.model, run.cluster, run.plan, run.workload, memory_headroom=0)
    eager_workload = run.workload.model_copy(update={"fused_elementwise": False})
    eager = estimate(run.model, run.cluster, run.plan, eager_workload, memory_headroom=0)
    assert 1.05 < compiled.tokens_per_s_per_gpu / eager.tokens_per_s_per_gpu < 1.25
    assert compiled.time_breakdown_s.compute < eager.time_breakdown_s.compute


def test_liger_rows_keep_no_logits_and_their_memory_is_the_measured_peak():
    """ml-engineering's ZeRO-3 offload runs ran Liger's fused linear cross-entropy: priced with it, the
    predicted memory per GPU at 32K-256K tokens is within 20 % below the source's peak reserved memory
    (which adds the allocator's cache), and every run fits, as it did."""
    bench = _module()
    ds = load_dataset(bench.DATA_PATHS[0])
    rows = [m for m in ds.measurements if m.source == "ml-engineering-zero3-offload" and m.seq_len >= 32768]
    assert len(rows) == 10
    for row in rows:
        run = measured_run(ds, row)
        assert run.workload.fused_cross_entropy
        est = estimate(run.model, run.cluster, run.plan, run.workload)
        measured = row.details["source_peak_reserved_gib"] * 2**30
        assert 0.8 < est.memory_per_gpu_bytes.total / measured <= 1.0, row.id
        assert est.fits, row.id
