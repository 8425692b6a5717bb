"""The published-measurement validation set parses into valid specs, and the accuracy benchmark runs.

No accuracy threshold here: benchmarks/throughput_accuracy.py reports the numbers. These tests check
that every row is a real, runnable layout, that inline model shapes reproduce the parameter counts the
sources print, and that measured values are converted with the sources' own formulas.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from service.calibrate.runs import row_plan
from service.catalog import load_model
from service.spec import check_plan

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark() -> ModuleType:
    name = "throughput_accuracy"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "throughput_accuracy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


ta = _load_benchmark()


@pytest.fixture(scope="module")
def ds():
    return ta.load_dataset()


def _row(ds, row_id):
    return next(r for r in ds.measurements if r.id == row_id)


def test_dataset_spans_sources_models_and_layouts(ds):
    rows = ds.measurements
    assert len(rows) >= 30
    used = {r.source for r in rows}
    assert used == set(ds.sources) and len(used) >= 4
    assert {r.gpu for r in rows} == {"a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb"}
    assert {r.recompute for r in rows} == {"none", "selective", "full"}
    assert min(r.seq_len for r in rows) <= 512 and max(r.seq_len for r in rows) >= 32768
    assert any(r.tp > 1 and r.pp > 1 for r in rows) and any(r.zero_stage == 3 for r in rows)


def test_inline_models_reproduce_source_parameter_counts(ds):
    checked = 0
    for name, entry in ds.models.items():
        spec = ta.model_spec(ds, name)
        if "source_num_params" in entry:
            assert spec.num_params == pytest.approx(entry["source_num_params"], rel=0.01), name
            checked += 1
        else:  # the source prints only a nominal size ("8B"): the shape must come from a config file
            assert re.search(r"\.(yaml|py)\b", entry["source"]), name
    # NeMo's configs name GPT-3 5B/20B and Nemotron 8B/22B by nominal size only.
    assert checked >= len(ds.models) - 4
    # Narayanan et al. Table 2 calls GPT-3 "174.6B"; the catalog entry must be that model.
    assert load_model("gpt3-175b").num_params == pytest.approx(174.6e9, rel=0.01)


def test_every_row_is_a_valid_plan_of_its_engine(ds):
    for row in ds.measurements:
        model, cluster = ta.model_spec(ds, row.model), ta.cluster_spec(row)
        plan = check_plan(row_plan(ds, row), model, cluster, ta.workload(ds, row))
        assert plan.num_gpus == cluster.num_gpus == row.num_gpus, row.id


def test_the_3d_rows_say_their_engine_cp_and_virtual_stages(ds):
    """28 rows of 2021-22 combine tp > 1 with pp > 1; none used context parallelism (they predate it);
    MT-NLG ran Megatron TP inside DeepSpeed's pipeline engine with ZeRO-1, a DeepSpeed 3D plan. NVIDIA's
    H100 recipes (2024-26) add 8 interleaved 3D rows, two of them with context parallelism 2."""
    three_d = [r for r in ds.measurements if r.tp > 1 and r.pp > 1]
    old = [r for r in three_d if r.source != "nemo-h100-fp8"]
    new = [r for r in three_d if r.source == "nemo-h100-fp8"]
    assert len(old) == 28 and all(r.cp == 1 for r in old)
    engines = {r.id: row_plan(ds, r).engine for r in three_d}
    assert {e for i, e in engines.items() if i.startswith("mtnlg")} == {"deepspeed"}
    assert sum(e == "megatron" for e in engines.values()) == 25 + len(new)
    assert [r.id for r in old if r.virtual_stages > 1] == [
        "korthikanti-t5-175b-full",
        "korthikanti-t5-175b-sel-sp",
        "korthikanti-t5-530b-full",
        "korthikanti-t5-530b-sel-sp",
        "korthikanti-abs-530b-n2240-full",
        "korthikanti-abs-530b-n2240-sel-sp",
    ]
    assert len(new) == 8 and all(r.virtual_stages > 1 and r.sequence_parallel for r in new)
    assert sorted(r.id for r in new if r.cp > 1) == [
        "bridge2606-llama31-405b-n1024",
        "nemo2407-llama3-70b-n64",
    ]
    assert all(r.precision == "fp8" for r in ds.measurements if r.source == "nemo-h100-fp8")


def test_step_times_reproduce_the_mfu_the_megatron_readme_prints(ds):
    """Korthikanti Table 5 times, through Eq. 7, give the README's 41.5/51.4/56.0/56.3 % MFU."""
    readme_mfu = {"22b": 0.415, "175b": 0.514, "530b": 0.560, "1t": 0.563}
    for tag, mfu in readme_mfu.items():
        row = _row(ds, f"korthikanti-t5-{tag}-sel-sp")
        model = ta.model_spec(ds, row.model)
        tokens = ta.measured_tokens_per_s_per_gpu(row, model)
        assert tokens * ta.korthikanti_eq7_flops_per_token(model, row.seq_len) / 312e12 == pytest.approx(
            mfu, abs=0.003
        )


def test_measured_values_convert_to_tokens_per_gpu(ds):
    row = _row(ds, "korthikanti-t5-22b-sel-sp")  # 4 sequences × 2048 tokens in 1.10 s on 8 GPUs
    assert ta.measured_tokens_per_s_per_gpu(row, ta.model_spec(ds, row.model)) == pytest.approx(
        930.9, abs=0.1
    )
    row = _row(ds, "narayanan-t1-gpt1008b-n3072")  # 163 TFLOP/s under Eq. 3
    model = ta.model_spec(ds, row.model)
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert ta.measured_tokens_per_s_per_gpu(row, model) == pytest.approx(163e12 / per_token)
    row = _row(ds, "mosaic-h100-mpt7b-s2048-n8-mb6")
    assert ta.measured_tokens_per_s_per_gpu(row, ta.model_spec(ds, row.model)) == 10643


def test_constant_mfu_baseline(ds):
    row = _row(ds, "mosaic-h100-mpt7b-s2048-n8-mb6")
    model, cluster = ta.model_spec(ds, row.model), ta.cluster_spec(row)
    per_token = 6 * model.num_params + 12 * 32 * 4096 * 2048
    expected = 0.4 * 989.4e12 / per_token
    assert ta.baseline_tokens_per_s_per_gpu(model, cluster.gpu, row, 0.4) == pytest.approx(expected)


def test_gpu_overrides_apply(ds):
    row = _row(ds, "torchtitan-h100-llama3-8b-n128")
    cluster = ta.cluster_spec(row)
    assert cluster.gpu.hbm_bandwidth_gb_per_s == 2400.0 and cluster.num_nodes == 16


def test_rank_statistics():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert ta.spearman(x, x * 10) == pytest.approx(1.0)
    assert ta.kendall_tau_b(x, -x) == pytest.approx(-1.0)
    assert ta.kendall_tau_b(x, np.array([1.0, 3.0, 2.0, 4.0])) == pytest.approx(4 / 6)
    assert math.isnan(ta.spearman(x, np.ones(4)))


def test_a_source_wide_offset_is_told_apart_from_the_rest_of_the_error():
    """Every row 10 % fast is one offset (nothing left after it); ±10 % about no offset stays 10 %."""
    same = ta._stats([{"e": 0.10}, {"e": 0.10}, {"e": 0.10}], "e")
    assert same["mape"] == pytest.approx(0.10) and same["mape_after_offset"] == pytest.approx(0.0, abs=1e-12)
    spread = ta._stats([{"e": 1.1 - 1}, {"e": 1 / 1.1 - 1}], "e")
    assert spread["bias_log"] == pytest.approx(0.0, abs=1e-12)
    assert spread["mape_after_offset"] == pytest.approx(spread["mape"])


def test_kendall_reference_bounds_what_ordering_can_reach():
    """Weak-scaling groups whose runs differ by 1-2 % cap τ whatever the model; a group spread over 2×
    does not. A model with no within-group error orders perfectly even when its errors are shuffled."""

    def rows(values, pred, group):
        return [
            {"model": group, "gpu": "g", "measured_tokens_per_s_per_gpu": m, "p": q}
            for m, q in zip(values, pred, strict=True)
        ]

    spread = [100.0, 140.0, 200.0, 280.0]
    flat = [100.0, 101.0, 102.0, 103.0]
    wide = ta.kendall_reference(rows(spread, [2 * v for v in spread], "a"), "p", draws=200)
    tight = ta.kendall_reference(rows(flat, flat, "b"), "p", draws=200)
    assert wide["own_errors_shuffled"] == pytest.approx(1.0)  # a common bias is not an ordering error
    assert wide["within_group_error_sd"] == pytest.approx(0.0, abs=1e-12)
    assert wide["exact_up_to_noise"]["0.03"] > 0.95
    noise = [tight["exact_up_to_noise"][f"{s:.2f}"] for s in ta.NOISE_SIGMAS]
    assert noise == sorted(noise, reverse=True) and noise[-1] < 0.5
    backwards = ta.kendall_reference(rows(spread, spread[::-1], "a"), "p", draws=200)
    assert backwards["own_errors_shuffled"] > -1.0  # shuffling the errors undoes their alignment


def test_accuracy_script_runs_and_writes_results(ds, tmp_path, capsys):
    out = tmp_path / "throughput_accuracy.json"
    assert ta.main(["--out", str(out), "--worst", "3", "--quick"]) == 0
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert len(rows) == len(ds.measurements)
    for r in rows:
        assert (
            math.isfinite(r["predicted_tokens_per_s_per_gpu"]) and r["predicted_tokens_per_s_per_gpu"] > 0
        ), r["id"]
        assert r["error"] == pytest.approx(
            r["predicted_tokens_per_s_per_gpu"] / r["measured_tokens_per_s_per_gpu"] - 1
        )
    summary = payload["summary"]
    assert set(summary["model"]["per_source"]) == set(ds.sources)
    assert summary["baseline"]["overall"]["n"] == len(rows)
    assert "worst 3 rows" in capsys.readouterr().out


def test_per_stack_reports_bias_scatter_and_coverage():
    """Two stacks: one 10 % slow throughout (a bias, no scatter), one ±5 % about none, half covered."""

    def row(stack, source, error, interval):
        return {
            "stack": stack,
            "source": source,
            "error": error,
            "measured_tokens_per_s_per_gpu": 100.0,
            "interval_80": interval,
        }

    rows = [
        row("a", "s1", -0.1, [95, 99]),
        row("a", "s1", -0.1, [95, 99]),
        row("b", "s2", 0.05, [90, 110]),
        row("b", "s3", 1 / 1.05 - 1, [101, 110]),
    ]
    out = ta.per_stack(rows)
    assert out["a"]["bias_log"] == pytest.approx(np.log(0.9)) and out["a"]["scatter_after_offset"] < 1e-12
    assert out["a"]["coverage_80"] == 0.0
    assert out["b"]["bias_log"] == pytest.approx(0.0, abs=1e-12)
    assert out["b"]["scatter_after_offset"] == pytest.approx(np.log(1.05))
    assert out["b"]["coverage_80"] == 0.5 and out["b"]["sources"] == ["s2", "s3"]


def test_this_services_h200_proxy_rows_are_valid_runs_kept_out_of_the_fit(ds):
    """benchmarks/published/service_h200_proxies.yaml: the project's own GPU measurements in the runs
    format, every row a valid DeepSpeed plan the model prices; not in measurements.yaml (their timed steps
    carried the activation meter's O(layers²) host cost)."""
    from service.calibrate.fit import predict_runs
    from service.calibrate.runs import load_dataset, load_runs
    from service.spec.params import load_params

    path = ROOT / "benchmarks" / "published" / "service_h200_proxies.yaml"
    proxies = load_dataset(path)
    assert {r.gpu for r in proxies.measurements} == {"h200-sxm-141gb"}
    assert not {r.id for r in proxies.measurements} & {r.id for r in ds.measurements}
    runs = load_runs(path)
    predicted = predict_runs(runs, load_params())
    assert np.all(np.isfinite(predicted)) and np.all(predicted > 0)
    assert all(r.plan.engine == "deepspeed" and r.plan.num_gpus == 1 for r in runs)
