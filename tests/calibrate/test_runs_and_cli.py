"""Runs files (YAML, CSV) load into measured runs; bad rows are one line naming the row and field;
`calibrate`, and `estimate --params`, work from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from service.calibrate import load_runs
from service.cli.main import main
from service.spec import SpecError
from service.spec.params import load_params

ROOT = Path(__file__).resolve().parents[2]
CSV_HEADER = "id,source,model,gpu,num_gpus,gpus_per_node,dp,tp,pp,zero_stage,micro_batch,grad_accum,"
CSV_HEADER += "global_batch,seq_len,recompute,tokens_per_s_per_gpu\n"


def _csv(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "runs.csv"
    path.write_text(CSV_HEADER + "\n".join(rows) + "\n")
    return path


def _row(i: int, source: str, gpus: int, tps: float, dp: int | None = None, mb: int = 2) -> str:
    dp = gpus if dp is None else dp
    return f"r{i},{source},llama2-7b,h100-sxm-80gb,{gpus},8,{dp},1,1,3,{mb},1,{dp * mb},4096,selective,{tps}"


def test_published_set_loads_every_row():
    runs = load_runs(ROOT / "benchmarks" / "published" / "measurements.yaml")
    assert len(runs) == 158 and all(r.tokens_per_s_per_gpu and r.tokens_per_s_per_gpu > 0 for r in runs)
    assert any(r.plan.tp > 1 and r.plan.pp > 1 for r in runs)  # Megatron 3D layouts kept as they ran


def test_sources_say_how_their_attention_and_element_wise_ops_ran():
    """Each source's kernels reach its runs' workloads: Megatron-LM 2021-22 materialised the scores, the
    FSDP sources ran fused attention, MosaicML's MPT fused its element-wise ops and fms-fsdp did not."""
    runs = load_runs(ROOT / "benchmarks" / "published" / "measurements.yaml")
    by_source = {r.source: r.workload for r in runs}
    assert not by_source["megatron-korthikanti2022"].flash_attention
    assert not by_source["megatron-nemo-launcher2022"].flash_attention
    assert by_source["torchtitan"].flash_attention and by_source["nemo-h100-fp8"].flash_attention
    assert by_source["mosaicml-llm-foundry"].fused_elementwise
    assert not by_source["ibm-fms-fsdp"].fused_elementwise
    # The published runs predate SDPA's cuDNN default (FlashAttention-2), whatever today's default
    # Workload says; this service's own H200 proxies ran torch 2.11, whose SDPA picks cuDNN's kernel.
    assert not any(w.cudnn_attention for w in by_source.values())
    proxies = load_runs(ROOT / "benchmarks" / "published" / "service_h200_proxies.yaml")
    assert len(proxies) == 10 and all(r.workload.cudnn_attention for r in proxies)


def test_published_hsdp_rows_shard_within_a_node():
    """fms-fsdp's 7B/13B runs are HSDP (shard inside a node, replicate across): FSDP plans with shard
    groups of 8, which the cost model prices with their intra-node gathers."""
    runs = {r.id: r for r in load_runs(ROOT / "benchmarks" / "published" / "measurements.yaml")}
    hsdp = [r for r in runs.values() if r.plan.shard_group_size]
    assert {r.id for r in hsdp} == {
        "ibm-blog-a100-llama2-7b", "ibm-blog-a100-llama2-13b", "ibm-blog-h100-llama2-7b",
        "ibm-blog-h100-llama2-13b", "ibm-readme-a100-llama2-13b-mb1",
    }  # fmt: skip
    assert all(r.plan.engine == "fsdp" and r.plan.shard_group_size == 8 for r in hsdp)


def test_a_users_hsdp_row_and_a_deepspeed_one_that_cannot_have_it(tmp_path):
    header = CSV_HEADER.replace(",tokens_per_s_per_gpu", ",engine,shard_group_size,tokens_per_s_per_gpu")
    path = tmp_path / "runs.csv"
    row = _row(0, "mine", 16, 4000.0).rsplit(",", 1)[0]
    path.write_text(header + f"{row},fsdp,8,4000.0\n")
    (run,) = load_runs(path)
    assert run.plan.short() == "fsdp:dp16-tp1-pp1-z3-sg8-mb2-ga1-rc:sele"
    path.write_text(header + f"{row},deepspeed,8,4000.0\n")
    with pytest.raises(SpecError) as err:
        load_runs(path)
    assert "shard_group_size" in str(err.value) and "removed MiCS" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_csv_runs_file(tmp_path):
    # a spreadsheet's trailing empty cells are not extra data
    runs = load_runs(_csv(tmp_path, [_row(0, "mine", 8, 5000.0) + ",,", _row(1, "mine", 16, 4800.0)]))
    assert [r.cluster.num_gpus for r in runs] == [8, 16] and runs[1].plan.dp == 16
    assert runs[0].tokens_per_s_per_gpu == 5000.0 and runs[0].model.name == "llama2-7b"


@pytest.mark.parametrize(
    ("row", "needles"),
    [
        (_row(0, "mine", 8, 5000.0, dp=4), ["measurements.0", "dp·tp·pp·cp = 4 but num_gpus = 8"]),
        (_row(0, "mine", 8, -1.0), ["measurements.0.measured.tokens_per_s_per_gpu"]),
        (_row(0, "mine", 8, 5000.0).replace(",4096,", ",4k,"), ["measurements.0.seq_len", "not an integer"]),
        (
            _row(0, "mine", 8, 5000.0).replace("llama2-7b", "llama9"),
            ["measurements.0.model", "unknown model"],
        ),
        (
            _row(0, "mine", 8, 5000.0).replace(",5000.0", ",abc"),
            ["measurements.0.tokens_per_s_per_gpu", "line 2"],
        ),
        (_row(0, "mine", 8, 5000.0) + ",extra", ["measurements.0", "more cells than the header"]),
        (  # 1e9 tokens/s of a 7B model: 4e10 TFLOP/s per H100
            _row(0, "mine", 8, 1e9),
            ["measurements.0.measured", "above the h100-sxm-80gb's bf16 peak of 989"],
        ),
    ],
)
def test_bad_rows_are_one_line_naming_row_and_field(tmp_path, row, needles):
    path = _csv(tmp_path, [row])
    with pytest.raises(SpecError) as err:
        load_runs(path)
    text = str(err.value)
    assert "\n" not in text and str(path) in text
    for needle in needles:
        assert needle in text, (needle, text)


def test_bad_yaml_row_names_the_row(tmp_path):
    data = yaml.safe_load((ROOT / "benchmarks" / "published" / "measurements.yaml").read_text())
    data["measurements"] = data["measurements"][:3]
    data["measurements"][2]["recompute"] = "sometimes"
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match=r"measurements\.2\.recompute"):
        load_runs(path)


def test_calibrate_cli_fits_cross_validates_and_writes_a_set_estimate_uses(tmp_path, capsys):
    measured = [(8, 4100), (16, 3900), (32, 3800), (64, 3500)]
    rows = [_row(i, f"lab{i % 3}", g, t * (1 + 0.01 * (i % 3))) for i, (g, t) in enumerate(measured * 3)]
    out = tmp_path / "mine.yaml"
    assert main(["calibrate", str(_csv(tmp_path, rows)), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)  # one JSON document
    assert set(report["crossval"]["per_source"]) == {"lab0", "lab1", "lab2"}
    assert report["params"]["fit_runs"] == 12 and report["written"] == str(out)
    params = load_params(out)
    assert params.name == "runs" and params.has_interval and params.domain.max_gpus == 64

    args = ["estimate", "--model", "llama2-7b", "--gpu", "h100-sxm-80gb", "--gpus", "32", "--zero", "3"]
    args += ["--micro-batch", "2", "--recompute", "selective", "--json", "--params", str(out)]
    assert main(args) == 0
    est = json.loads(capsys.readouterr().out)
    low, high = est["tokens_per_s_interval"]
    assert low <= est["tokens_per_s"] <= high and low < high
    assert est["params"]["name"] == "runs" and est["params"]["fit_on"] == ["lab0", "lab1", "lab2"]
    # Measured ~3,800 tokens/s per GPU at 32 GPUs; calibrated on these runs the estimate is near it.
    assert est["tokens_per_s_per_gpu"] == pytest.approx(3800, rel=0.15)


def test_a_users_yaml_needs_neither_models_nor_refs_but_at_least_one_run(tmp_path):
    row = {"id": "r1", "source": "mylab", "model": "llama2-7b", "gpu": "a100-sxm-80gb", "num_gpus": 8,
           "dp": 8, "tp": 1, "pp": 1, "zero_stage": 3, "micro_batch": 2, "grad_accum": 4, "global_batch": 64,
           "seq_len": 4096, "recompute": "none", "measured": {"tokens_per_s_per_gpu": 3100}}  # fmt: skip
    data = {
        "sources": {"mylab": {"citation": "our logs", "framework": "DeepSpeed", "metric": "tokens/s/GPU"}}
    }
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**data, "measurements": [row]}))
    (run,) = load_runs(path)
    assert run.tokens_per_s_per_gpu == 3100
    path.write_text(yaml.safe_dump({**data, "measurements": []}))
    with pytest.raises(SpecError, match="measurements: List should have at least 1 item"):
        load_runs(path)


def test_one_source_is_fit_without_an_interval_and_says_so(tmp_path, capsys):
    rows = [_row(i, "lab0", g, t) for i, (g, t) in enumerate([(8, 4100), (16, 3900)])]
    out = tmp_path / "one.yaml"
    assert main(["calibrate", str(_csv(tmp_path, rows)), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "crossval" not in report and "one source" in report["crossval_skipped"]
    assert report["params"]["interval"].startswith("none: fit without leave-one-source-out")
    assert main(["plan", str(ROOT / "experiments/llama2-13b-32xh100.yaml"), "--params", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(no interval;" in text and "h (no interval), $" in text  # not a zero-width "80 % interval"


def test_memory_parameters_cannot_be_fit_on_a_runs_file(tmp_path, capsys):
    rows = [_row(i, f"lab{i % 2}", g, t) for i, (g, t) in enumerate([(8, 4100), (16, 3900)])]
    for fit in ("activation_memory_scale", "gemm_efficiency_scale,activation_memory_scale"):
        assert main(["calibrate", str(_csv(tmp_path, rows)), "--fit", fit]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: --fit: activation_memory_scale")


def test_calibrate_cli_bad_file_is_one_line(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no such file" in err


def test_shipped_set_says_what_it_was_fit_on():
    params = load_params()
    published = load_runs(ROOT / "benchmarks" / "published" / "measurements.yaml")
    assert params.name == "published-set" and params.has_interval
    # Refit whenever the published set changes: it must be fit on exactly the set that ships.
    assert params.fit_runs == len(published) and params.fit_on == sorted({r.source for r in published})
    assert "benchmarks/published/measurements.yaml" in params.note
    for name, band in params.values.items():
        assert band.low <= band.value <= band.high, name


def test_a_profile_replaces_the_catalog_spec_of_its_gpu_type_only(tmp_path):
    from service.calibrate.runs import with_profiles
    from service.profile import load_profile

    profile_path = ROOT / "benchmarks" / "results" / "cpu_profile" / "run1.yaml"
    profile = load_profile(profile_path)
    runs = load_runs(_csv(tmp_path, [_row(0, "mine", 8, 5000.0)]))
    cpu_run = runs[0].model_copy(
        update={"cluster": runs[0].cluster.model_copy(update={"gpu": _catalog("cpu")})}
    )
    out = with_profiles([runs[0], cpu_run], [profile_path])
    assert out[0] == runs[0]  # an H100 run: no profile for it
    assert out[1].cluster.gpu == profile.gpu_spec() and out[1].cluster.gpu.name == "cpu"


def _catalog(name: str):
    from service.catalog import load_gpu

    return load_gpu(name)


@pytest.mark.parametrize(
    ("field", "value", "bad"),
    [
        ("zero3_collectives", "per_tensor_lists", "per_module"),
        ("selective_recompute", "every_other_matmul", "op"),
    ],
)
def test_a_runs_file_says_how_its_engine_ran(tmp_path, field, value, bad):
    """Row fields that describe the run's software reach its Workload; a bad one names row and field."""
    data = yaml.safe_load((ROOT / "benchmarks" / "published" / "measurements.yaml").read_text())
    data["measurements"] = [next(m for m in data["measurements"] if m.get(field) == value)]
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    (run,) = load_runs(path)
    assert getattr(run.workload, field) == value
    data["measurements"][0][field] = bad
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match=rf"measurements\.0\.{field}") as err:
        load_runs(path)
    assert "\n" not in str(err.value)


def test_a_spreadsheets_spaced_header_and_yes_no_cells(tmp_path):
    """Headers with a space after each comma are read; a measurement that is not a number and a flag
    that is not yes or no are one line naming the field (the first crashed with a KeyError)."""
    header = CSV_HEADER.replace(",", ", ").replace(
        "tokens_per_s_per_gpu\n", "sequence_parallel, tokens_per_s_per_gpu\n"
    )
    good = _row(0, "mine", 8, 5000.0).replace(",selective,", ",selective,no,").replace(",", ", ")
    path = tmp_path / "spaced.csv"
    path.write_text(header + good + "\n")
    (run,) = load_runs(path)
    assert run.tokens_per_s_per_gpu == 5000.0 and not run.plan.sequence_parallel
    for bad, needle in (
        (good.replace("5000.0", "fast"), "measurements.0.tokens_per_s_per_gpu: not a number: 'fast'"),
        (good.replace(", no,", ", maybe,"), "measurements.0.sequence_parallel: not a yes/no value: 'maybe'"),
    ):
        path.write_text(header + bad + "\n")
        with pytest.raises(SpecError) as err:
            load_runs(path)
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_csv_runs_kernels_default_to_what_estimate_assumes_and_can_be_stated(tmp_path):
    from service.spec.workload import Workload

    rows = [_row(i, "lab0", g, t) for i, (g, t) in enumerate([(8, 4100), (16, 3900)])]
    (default,) = {r.workload.cudnn_attention for r in load_runs(_csv(tmp_path, rows))}
    assert default is Workload.model_fields["cudnn_attention"].default is True
    path = tmp_path / "stated.csv"
    path.write_text(
        CSV_HEADER.rstrip("\n") + ",cudnn_attention,fused_elementwise\n"
        + "\n".join(f"{r},no,yes" for r in rows) + "\n"
    )  # fmt: skip
    runs = load_runs(path)
    assert {(r.workload.cudnn_attention, r.workload.fused_elementwise) for r in runs} == {(False, True)}
    path.write_text(CSV_HEADER.rstrip("\n") + ",cudnn_attention\n" + f"{rows[0]},no\n{rows[1]},yes\n")
    with pytest.raises(SpecError, match=r"measurements\.1\.cudnn_attention: True on line 3, False on line 2"):
        load_runs(path)
    path.write_text(CSV_HEADER.rstrip("\n") + ",cudnn_attention\n" + f"{rows[0]},\n{rows[1]},no\n")
    assert {r.workload.cudnn_attention for r in load_runs(path)} == {False}  # a blank cell states nothing


def test_an_inline_models_bad_field_and_a_partial_node_are_named(tmp_path):
    row = {"id": "r1", "source": "a", "model": "mymodel", "gpu": "h100-sxm-80gb", "num_gpus": 8, "dp": 8,
           "tp": 1, "pp": 1, "zero_stage": 3, "micro_batch": 1, "grad_accum": 1, "global_batch": 8,
           "seq_len": 4096, "recompute": "none", "measured": {"tokens_per_s_per_gpu": 3000}}  # fmt: skip
    data = {"sources": {"a": {"citation": "x", "framework": "y", "metric": "z"}},
            "models": {"mymodel": {"num_layers": 2, "hidden_size": -5}}, "measurements": [row]}  # fmt: skip
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as err:
        load_runs(path)
    assert (err.value.field, err.value.message) == (
        "models.mymodel.hidden_size",
        "r1: Input should be greater than 0",
    )
    data["models"] = {}
    data["measurements"] = [{**row, "model": "llama2-7b", "num_gpus": 12, "dp": 12, "global_batch": 12}]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match="12 GPUs are no whole number of 8-GPU nodes") as err:
        load_runs(path)
    assert err.value.field == "measurements.0.num_gpus"
