"""Malformed input over `plan`, `estimate`, `calibrate` and the experiment loader (issue #35).

Every case runs in-process through `service.cli.main.main` (or `load_experiment`) and must end the
same way: exit status 2, exactly one line on stderr naming the field, flag or file at fault, no
traceback, and no file written. The corpus is fixed (bad numbers, wrong types, unknown keys, empty,
binary, UTF-16 and Latin-1 files, huge and negative values, missing files, folders for files), so a
failure names its case and reruns the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.cli.main import main
from service.spec import SpecError, load_experiment

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "experiments" / "tiny-cpu.yaml"
MEASUREMENTS = ROOT / "benchmarks" / "published" / "measurements.yaml"

# What a file that should hold YAML / JSON / CSV may hold instead: (content, what the error names).
# `None` content = no file there; "DIR" = a folder there.
BAD_FILES: dict[str, bytes | str | None] = {
    "missing": None,
    "directory": "DIR",
    "empty": b"",
    "blank": b"  \n\n\t\n",
    "null": b"null\n",
    "list": b"- 1\n- 2\n",
    "scalar": b"hello\n",
    "number": b"42\n",
    "binary": bytes(range(256)) * 4,
    "nul-bytes": b"\x00" * 64,
    "gzip": b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + bytes(range(200, 256)),
    "utf16-bom": "name: x\nnum_layers: 2\n".encode("utf-16"),
    "utf16le": "name: x\nnum_layers: 2\n".encode("utf-16-le"),
    "latin1": "name: caf\xe9\n".encode("latin-1"),
    "bad-yaml": b"a: [1, 2\n",
    "tab-indent": b"a:\n\tb: 1\n",
    "control-char": b"name: \x07bell\n",
    "json-garbage": b"{not json",
}


def _tiny(**edits: Any) -> dict[str, Any]:
    data = yaml.safe_load(TINY.read_text())
    for dotted, value in edits.items():
        *parents, key = dotted.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is _DROP:
            node.pop(key)
        else:
            node[key] = value
    return data


_DROP = object()

# A mixture-of-experts block for tiny-cpu's model (8 experts of its width, top-2).
MOE = {"num_experts": 8, "experts_per_token": 2, "expert_ffn_hidden_size": 512}
# Experiment fields that are wrong: (edits to tiny-cpu.yaml, the field the one line must name).
BAD_EXPERIMENTS: dict[str, tuple[dict[str, Any], str]] = {
    "name-empty": ({"name": ""}, "name"),
    "name-blank": ({"name": "   "}, "name"),
    "name-traversal": ({"name": "../../../../tmp/x/escaped"}, "name"),
    "name-slash": ({"name": "a/b"}, "name"),
    "name-backslash": ({"name": "a\\b"}, "name"),
    "name-dotdot": ({"name": ".."}, "name"),
    "name-dot": ({"name": "."}, "name"),
    "name-absolute": ({"name": "/etc"}, "name"),
    "name-nul": ({"name": "a\x00b"}, "name"),
    "name-newline": ({"name": "a\nb"}, "name"),
    "name-too-long": ({"name": "x" * 300}, "name"),
    "name-int": ({"name": 123}, "name"),
    "name-list": ({"name": ["a"]}, "name"),
    "name-missing": ({"name": _DROP}, "name"),
    "unknown-key": ({"nmae": "x"}, "nmae"),
    "unknown-nested-key": ({"cluster.gpus": 8}, "cluster.gpus"),
    "cluster-string": ({"cluster": "big"}, "cluster"),
    "num-nodes-negative": ({"cluster.num_nodes": -1}, "cluster.num_nodes"),
    "num-nodes-zero": ({"cluster.num_nodes": 0}, "cluster.num_nodes"),
    "num-nodes-huge": ({"cluster.num_nodes": 1e9}, "cluster.num_nodes"),
    "num-nodes-text": ({"cluster.num_nodes": "four"}, "cluster.num_nodes"),
    "num-nodes-bool": ({"cluster.num_nodes": True}, "cluster.num_nodes"),
    "num-nodes-fraction": ({"cluster.num_nodes": 1.5}, "cluster.num_nodes"),
    "gpus-per-node-huge": ({"cluster.gpus_per_node": 10**9}, "cluster.gpus_per_node"),
    "gpu-unknown": ({"cluster.gpu": "h900"}, "cluster.gpu"),
    "price-negative": ({"cluster.price_per_gpu_hour_usd": -3}, "cluster.price_per_gpu_hour_usd"),
    "price-inf": ({"cluster.price_per_gpu_hour_usd": float("inf")}, "cluster.price_per_gpu_hour_usd"),
    "seq-len-zero": ({"workload.seq_len": 0}, "workload.seq_len"),
    "seq-len-negative": ({"workload.seq_len": -64}, "workload.seq_len"),
    "seq-len-huge": ({"workload.seq_len": 10**12}, "workload.seq_len"),
    "seq-len-text": ({"workload.seq_len": "abc"}, "workload.seq_len"),
    "seq-len-nan": ({"workload.seq_len": float("nan")}, "workload.seq_len"),
    "batch-huge": ({"workload.global_batch_sequences": 10**15}, "global_batch_sequences"),
    "tokens-negative": ({"workload.tokens_to_train": -1e9}, "workload.tokens_to_train"),
    "tokens-zero": ({"workload.tokens_to_train": 0}, "workload.tokens_to_train"),
    "tokens-nan": ({"workload.tokens_to_train": float("nan")}, "workload.tokens_to_train"),
    "tokens-inf": ({"workload.tokens_to_train": float("inf")}, "workload.tokens_to_train"),
    "tokens-text": ({"workload.tokens_to_train": "lots"}, "workload.tokens_to_train"),
    "tokens-below-one-step": ({"workload.tokens_to_train": 100}, "workload.tokens_to_train"),
    "workload-missing": ({"workload": _DROP}, "workload"),
    "budget-negative": ({"budget.max_dollars": -5}, "budget.max_dollars"),
    "budget-nan": ({"budget.max_hours": float("nan")}, "budget.max_hours"),
    "headroom-above-one": ({"budget.memory_headroom": 1.5}, "budget.memory_headroom"),
    "objective-unknown": ({"budget.objective": "fast"}, "budget.objective"),
    "proxy-layers-above-model": ({"proxy.num_layers": 8}, "proxy.num_layers"),
    "proxy-steps-below-warmup": ({"proxy.steps": 1}, "proxy.steps"),
    "proxy-steps-equal-warmup": ({"proxy.steps": 2}, "proxy.steps"),
    "proxy-workers-huge": ({"proxy.num_workers": 1e9}, "proxy.num_workers"),
    "proxy-workers-negative": ({"proxy.num_workers": -2}, "proxy.num_workers"),
    "proxy-device-unknown": ({"proxy.device": "tpu"}, "proxy.device"),
    "model-unknown": ({"model": "llama9"}, "model"),
    "model-missing-file": ({"model": "nowhere.yaml"}, "nowhere.yaml"),
    "model-layers-negative": ({"model.num_layers": -4}, "model.num_layers"),
    "model-layers-huge": ({"model.num_layers": 10**9}, "model.num_layers"),
    "model-hidden-text": ({"model.hidden_size": "big"}, "model.hidden_size"),
    "model-heads-zero": ({"model.num_attention_heads": 0}, "model.num_attention_heads"),
    "model-unknown-key": ({"model.layers": 4}, "model.layers"),
    "engines-unknown": ({"engines": ["torch"]}, "engines"),
    "engines-string": ({"engines": "deepspeed"}, "engines"),
    "optimizer-lr-negative": ({"optimizer": {"lr": -1}}, "optimizer.lr"),
    "tracking-list": ({"tracking": [1, 2]}, "tracking"),
    "tracking-experiment-empty": ({"tracking.experiment_name": ""}, "tracking.experiment_name"),
    "price-huge": ({"cluster.price_per_gpu_hour_usd": 1e308}, "cluster.price_per_gpu_hour_usd"),
    "bandwidth-huge": (
        {"cluster.inter_node_bandwidth_gb_per_s": 1e308},
        "cluster.inter_node_bandwidth_gb_per_s",
    ),
    "moe-capacity-inf": (
        {"model.moe": {**MOE, "router": "capacity", "capacity_factor": float("inf")}},
        "model.moe.capacity_factor",
    ),
    "moe-capacity-huge": (
        {"model.moe": {**MOE, "router": "capacity", "capacity_factor": 1e6}},
        "model.moe.capacity_factor",
    ),
    "moe-top-k-beyond-its-groups": (
        {"model.moe": {**MOE, "experts_per_token": 4, "expert_groups": 4, "groups_per_token": 1}},
        "model.moe.experts_per_token",
    ),
}


def _write(path: Path, content: bytes | str | None) -> Path:
    if content == "DIR":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    return path


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _run(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`main(argv)` from inside tmp_path: (exit status, stderr lines); fails on a traceback or a file
    written."""
    before = _files(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code if isinstance(exit_.code, int) else 1
    except Exception as err:  # what a user would see as a traceback
        pytest.fail(f"traceback: {type(err).__name__}: {err}"[:300])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert _files(tmp_path) == before, "a file was written on bad input"
    return code, err.splitlines()


def _one_line(code: int, lines: list[str], *names: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert any(n in lines[0] for n in names), (names, lines[0])


# --- files that are not what they should be, in every slot a command reads one --------------------

EST = ["estimate", "--model", "llama2-13b", "--gpu", "h100-sxm-80gb"]
SLOTS: dict[str, Callable[[Path], list[str]]] = {
    "plan-experiment": lambda f: ["plan", str(f)],
    "plan-params": lambda f: ["plan", str(TINY), "--params", str(f)],
    "estimate-model-yaml": lambda f: ["estimate", "--model", str(f), "--gpu", "cpu", "--gpus", "2"],
    "estimate-params": lambda f: [*EST, "--gpus", "8", "--params", str(f)],
    "calibrate-runs": lambda f: ["calibrate", str(f), "--no-crossval"],
    "calibrate-prior": lambda f: ["calibrate", str(MEASUREMENTS), "--prior", str(f)],
}
SLOTS["estimate-model-json"] = SLOTS["estimate-model-yaml"]
SLOTS["calibrate-runs-csv"] = SLOTS["calibrate-runs"]
SUFFIX = {"estimate-model-json": ".json", "calibrate-runs-csv": ".csv"}  # the rest: .yaml


@pytest.mark.parametrize("kind", list(BAD_FILES))
@pytest.mark.parametrize("slot", list(SLOTS))
def test_bad_file(slot: str, kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    path = _write(inputs / f"{kind}{SUFFIX.get(slot, '.yaml')}", BAD_FILES[kind])
    code, lines = _run(SLOTS[slot](path), tmp_path, capsys)
    _one_line(code, lines, path.name)


# --- experiment fields: through `plan` and through the Python loader -------------------------------


@pytest.mark.parametrize("case", list(BAD_EXPERIMENTS))
def test_bad_experiment_field(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edits, field = BAD_EXPERIMENTS[case]
    path = tmp_path / "in" / "exp.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(_tiny(**edits), allow_unicode=True))
    code, lines = _run(["plan", str(path)], tmp_path, capsys)
    _one_line(code, lines, field)
    with pytest.raises(SpecError) as info:  # the Python API: one exception type, a ValueError
        load_experiment(path)
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and field in str(info.value)


# --- flags ----------------------------------------------------------------------------------------

BAD_FLAGS: dict[str, tuple[list[str], str]] = {
    "plan-top-negative": (["plan", str(TINY), "--top", "-1"], "--top"),
    "plan-top-text": (["plan", str(TINY), "--top", "ten"], "--top"),
    "plan-top-huge-float": (["plan", str(TINY), "--top", "1e9"], "--top"),
    "plan-micro-batch-zero": (["plan", str(TINY), "--max-micro-batch", "0"], "--max-micro-batch"),
    "plan-engines-unknown": (["plan", str(TINY), "--engines", "torch"], "--engines"),
    "plan-engines-empty": (["plan", str(TINY), "--engines", ","], "--engines"),
    "plan-precision": (["plan", str(TINY), "--precision", "fp4"], "--precision"),
    "plan-no-experiment": (["plan"], "experiment"),
    "gpus-huge": ([*EST, "--gpus", "1000000000"], "--gpus"),
    "gpus-zero": ([*EST, "--gpus", "0"], "--gpus"),
    "gpus-negative": ([*EST, "--gpus", "-8"], "--gpus"),
    "gpus-text": ([*EST, "--gpus", "eight"], "--gpus"),
    "gpus-float": ([*EST, "--gpus", "8.5"], "--gpus"),
    "gpus-empty": ([*EST, "--gpus", ""], "--gpus"),
    "gpus-not-whole-nodes": ([*EST, "--gpus", "12"], "--gpus"),
    "gpus-per-node-zero": ([*EST, "--gpus", "8", "--gpus-per-node", "0"], "--gpus-per-node"),
    "tp-not-dividing": ([*EST, "--gpus", "8", "--tp", "3"], "--tp"),
    "tp-huge": ([*EST, "--gpus", "8", "--tp", "1000000000"], "--tp"),
    "pp-negative": ([*EST, "--gpus", "8", "--pp", "-2"], "--pp"),
    "zero-5": ([*EST, "--gpus", "8", "--zero", "5"], "--zero"),
    "micro-batch-huge": ([*EST, "--gpus", "8", "--micro-batch", "1000000000000"], "micro_batch × grad_accum"),
    "grad-accum-huge": ([*EST, "--gpus", "8", "--grad-accum", "1000000000000"], "micro_batch × grad_accum"),
    "seq-len-huge": ([*EST, "--gpus", "8", "--seq-len", "1000000000000"], "--seq-len"),
    "seq-len-zero": ([*EST, "--gpus", "8", "--seq-len", "0"], "--seq-len"),
    "tokens-negative-exp": ([*EST, "--gpus", "8", "--tokens-to-train", "-1e9"], "--tokens-to-train"),
    "tokens-negative": ([*EST, "--gpus", "8", "--tokens-to-train", "-5"], "--tokens-to-train"),
    "tokens-zero": ([*EST, "--gpus", "8", "--tokens-to-train", "0"], "--tokens-to-train"),
    "tokens-nan": ([*EST, "--gpus", "8", "--tokens-to-train", "nan"], "--tokens-to-train"),
    "tokens-inf": ([*EST, "--gpus", "8", "--tokens-to-train", "inf"], "--tokens-to-train"),
    "tokens-overflow": ([*EST, "--gpus", "8", "--tokens-to-train", "1e400"], "--tokens-to-train"),
    "tokens-text": ([*EST, "--gpus", "8", "--tokens-to-train", "lots"], "--tokens-to-train"),
    "tokens-below-one-step": ([*EST, "--gpus", "8", "--tokens-to-train", "1000"], "--tokens-to-train"),
    "headroom-above-one": ([*EST, "--gpus", "8", "--headroom", "1.5"], "--headroom"),
    "headroom-negative": ([*EST, "--gpus", "8", "--headroom", "-0.1"], "--headroom"),
    "price-negative": ([*EST, "--gpus", "8", "--price-per-gpu-hour", "-1"], "--price-per-gpu-hour"),
    "bandwidth-zero": ([*EST, "--gpus", "8", "--inter-node-bandwidth", "0"], "--inter-node-bandwidth"),
    "bandwidth-negative": ([*EST, "--gpus", "8", "--inter-node-bandwidth", "-5"], "--inter-node-bandwidth"),
    "shard-group-negative": ([*EST, "--gpus", "8", "--shard-group-size", "-1"], "--shard-group-size"),
    "model-unknown": (["estimate", "--model", "llama9", "--gpu", "cpu", "--gpus", "2"], "--model"),
    "gpu-unknown": (["estimate", "--model", "llama2-13b", "--gpu", "h900", "--gpus", "8"], "--gpu"),
    "gpu-missing": (["estimate", "--model", "llama2-13b", "--gpus", "8"], "--gpu"),
    "calibrate-fit-unknown": (["calibrate", str(MEASUREMENTS), "--fit", "bogus"], "--fit"),
    "calibrate-fit-empty": (["calibrate", str(MEASUREMENTS), "--fit", ","], "--fit"),
    "calibrate-out-missing-parent": (
        ["calibrate", str(MEASUREMENTS), "--out", "/nonexistent/dir/p.yaml"],
        "--out",
    ),
    "calibrate-out-relative-missing-parent": (
        ["calibrate", str(MEASUREMENTS), "--out", "no/p.yaml"],
        "--out",
    ),
    "calibrate-out-directory": (["calibrate", str(MEASUREMENTS), "--out", "."], "--out"),
    "calibrate-out-pseudo-fs": (["calibrate", str(MEASUREMENTS), "--out", "/proc/p.yaml"], "--out"),
    "calibrate-out-device": (["calibrate", str(MEASUREMENTS), "--out", "/dev/null"], "--out"),
    "calibrate-out-name-too-long": (["calibrate", str(MEASUREMENTS), "--out", "p" * 300 + ".yaml"], "--out"),
    "calibrate-out-empty": (["calibrate", str(MEASUREMENTS), "--out", ""], "--out"),
    "run-out-pseudo-fs": (["run", str(TINY), "--no-proxies", "--out", "/proc/run"], "--out"),
    "report-out-pseudo-fs": (["report", ".", "--out", "/proc/memo"], "--out"),
    "price-huge": ([*EST, "--gpus", "8", "--price-per-gpu-hour", "1e308"], "--price-per-gpu-hour"),
    "bandwidth-subnormal": (
        [*EST, "--gpus", "8", "--inter-node-bandwidth", "1e-320"],
        "--inter-node-bandwidth",
    ),
    "tokens-huge": ([*EST, "--gpus", "8", "--tokens-to-train", "1e308"], "--tokens-to-train"),
    "moe-imbalance-on-a-dense-model": (
        [*EST, "--gpus", "8", "--moe-load-imbalance", "2"],
        "--moe-load-imbalance",
    ),
    "calibrate-profile-missing": (["calibrate", str(MEASUREMENTS), "--profile", "nope.yaml"], "nope.yaml"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_flag(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv, name = BAD_FLAGS[case]
    code, lines = _run(argv, tmp_path, capsys)
    _one_line(code, lines, name)
    assert not Path("/nonexistent").exists()


def test_corpus_size() -> None:
    """The number of malformed inputs tried, as the issue counts them."""
    total = len(SLOTS) * len(BAD_FILES) + len(BAD_EXPERIMENTS) + len(BAD_FLAGS)
    assert total >= 132


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_a_measured_value_that_is_not_finite_is_named(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "in" / "runs.csv"
    runs.parent.mkdir()
    header = "id,source,model,gpu,num_gpus,gpus_per_node,dp,tp,pp,zero_stage,micro_batch,grad_accum,"
    header += "global_batch,seq_len,recompute,tokens_per_s_per_gpu\n"
    rows = f"r1,a,llama2-13b,h100-sxm-80gb,8,8,4,2,1,1,1,8,32,4096,none,{value}\n"
    rows += "r2,b,llama2-7b,h100-sxm-80gb,8,8,8,1,1,1,2,2,32,4096,none,4500\n"
    runs.write_text(header + rows)
    code, lines = _run(["calibrate", str(runs), "--no-crossval", "--json"], tmp_path, capsys)
    _one_line(code, lines, "measured.tokens_per_s_per_gpu")


def test_a_csv_saved_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    """Spreadsheets save UTF-8 CSV with a byte-order mark; the first column is still `id`."""
    from service.calibrate.runs import load_runs

    header = "id,source,model,gpu,num_gpus,gpus_per_node,dp,tp,pp,zero_stage,micro_batch,grad_accum,"
    header += "global_batch,seq_len,recompute,tokens_per_s_per_gpu\n"
    row = "r1,a,llama2-7b,h100-sxm-80gb,8,8,8,1,1,1,2,2,32,4096,none,4500\n"
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    plain.write_text(header + row)
    marked.write_bytes(b"\xef\xbb\xbf" + (header + row).encode())
    assert [r.id for r in load_runs(marked)] == [r.id for r in load_runs(plain)] == ["r1"]
