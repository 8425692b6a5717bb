"""`python -m service plan`: the table, the JSON contract, the no-budget answer and bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from service.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "experiments" / "llama2-13b-32xh100.yaml"
HEAVY = ("torch", "ray", "deepspeed")


def write_experiment(tmp_path: Path, name: str, edit) -> Path:
    data = yaml.safe_load(EXPERIMENT.read_text())
    edit(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_prints_aligned_table_and_selection(capsys):
    assert main(["plan", str(EXPERIMENT), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "46,200 candidate plans, 2,730 valid plans scored" in out
    assert "selected: dp" in out and "memory per GPU (GiB)" in out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("#  plan"))
    header, rows = lines[head], lines[head + 2 : head + 7]
    assert len(rows) == 5 and rows[0].startswith("1  ") and " selected " in rows[0]
    for column in ("mem GiB", "tokens/s", "MFU", "dollars"):  # right-aligned under their headers
        end = header.index(column) + len(column)
        for row in rows:
            assert row[end - 1] != " " and (end == len(row) or row[end] == " "), (column, row)
    assert re.search(r"^over memory\s+[\d,]+$", out, re.M)


def test_plan_json_has_the_contract_fields(capsys):
    assert main(["plan", str(EXPERIMENT), "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    selected = data["selected"]
    assert selected["status"] == "selected" and selected["rank"] == 1
    assert set(selected["plan"]) >= {"dp", "tp", "pp", "zero_stage", "micro_batch", "grad_accum", "recompute"}
    memory = selected["memory_per_gpu_bytes"]
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(memory)
    assert memory["total"] <= selected["memory_limit_bytes"]
    assert selected["tokens_per_s"] > 0 and 0 < selected["hours"] <= 24 and 0 < selected["dollars"] <= 1500
    assert len(data["ranked"]) == 3 and data["ranked"][0] == selected
    # The top plans tie (within the model's resolution of the cheapest): the safest leads them.
    dollars = [r["dollars"] for r in data["ranked"]]
    assert max(dollars) / min(dollars) < 1.2 and {r["status"] for r in data["ranked"][1:]} <= {
        "tied",
        "riskier",
    }
    assert "wins the tie" in data["message"]
    assert data["plans_evaluated"] == 2730 and data["candidates"] == 46200
    assert sum(data["rejected_counts"].values()) + 1 == data["candidates"]
    assert data["rejected_counts"]["over memory"] > 0


def test_plan_prune_scores_fewer_plans_and_chooses_the_same(capsys):
    """`plan --prune` (the bounded ranking): the same choice and top plans, fewer plans scored, and every
    candidate still accounted for (the unscored ones as "slower (bounded, not scored)")."""
    assert main(["plan", str(EXPERIMENT), "--top", "3", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main(["plan", str(EXPERIMENT), "--top", "3", "--json", "--prune"]) == 0
    pruned = json.loads(capsys.readouterr().out)
    assert pruned["selected"]["label"] == full["selected"]["label"]
    assert [r["label"] for r in pruned["ranked"]] == [r["label"] for r in full["ranked"]]
    assert pruned["plans_evaluated"] < full["plans_evaluated"]
    assert pruned["rejected_counts"]["slower (bounded, not scored)"] > 0
    assert sum(pruned["rejected_counts"].values()) + 1 == pruned["candidates"] == full["candidates"]


def test_plan_with_an_unmeetable_budget_names_the_binding_constraint(tmp_path, capsys):
    path = write_experiment(tmp_path, "poor", lambda d: d["budget"].update(max_dollars=50))
    assert main(["plan", str(path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["selected"] is None and data["binding_constraint"] == "max_dollars"
    assert data["fallback"]["hours"] <= 24 and data["fallback"]["dollars"] > 50
    assert "max_dollars binds" in data["message"]
    assert main(["plan", str(path)]) == 1
    out = capsys.readouterr().out
    assert "no plan meets the budget" in out and "fallback: dp" in out


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize(
    ("name", "edit", "needles"),
    [
        (
            "unknown-key",
            lambda d: d.update(nmae=d.pop("name")),
            ["nmae: unknown field", "allowed: ", "budget, cluster", "model, name"],
        ),
        (
            "nested-key",
            lambda d: d["budget"].update(max_hourz=3),
            ["budget.max_hourz", "allowed: max_dollars"],
        ),
        (
            "negative-budget",
            lambda d: d["budget"].update(max_dollars=-5),
            ["budget.max_dollars", "greater than 0"],
        ),
        ("unknown-gpu", lambda d: d["cluster"].update(gpu="h900"), ["cluster.gpu", "allowed: a100-sxm-40gb"]),
        ("unknown-model", lambda d: d.update(model="llama9-13b"), ["model", "allowed: codellama-34b"]),
        ("zero-nodes", lambda d: d["cluster"].update(num_nodes=0), ["cluster.num_nodes", "greater than 0"]),
        (
            "bad-objective",
            lambda d: d["budget"].update(objective="speed"),
            ["budget.objective", "'throughput'"],
        ),
    ],
)
def test_bad_experiment_is_one_line_naming_file_and_field(tmp_path, capsys, name, edit, needles):
    path = write_experiment(tmp_path, name, edit)
    _one_line_error(capsys, ["plan", str(path)], f"{name}.yaml", *needles)


def test_missing_or_malformed_file_and_bad_flags(tmp_path, capsys):
    _one_line_error(capsys, ["plan", str(tmp_path / "nope.yaml")], "nope.yaml", "no such file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    _one_line_error(capsys, ["plan", str(bad)], "bad.yaml", "not valid YAML")
    _one_line_error(capsys, ["plan", str(EXPERIMENT), "--top", "-1"], "--top")
    _one_line_error(capsys, ["plan", str(EXPERIMENT), "--max-micro-batch", "0"], "--max-micro-batch")


def run_light(argv: list[str]) -> tuple[dict, float]:
    """The CLI in a fresh interpreter: (exit code, heavy modules loaded, import time), wall time."""
    code = (
        "import time; t0 = time.perf_counter()\n"
        "import sys, io, json, contextlib\n"
        "import service.cli.main, service.planner, service.costmodel\n"
        "start_s = time.perf_counter() - t0\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = service.cli.main.main({argv!r})\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy, 'start_s': start_s}))\n"
    )
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), time.perf_counter() - started


def test_plan_subprocess_is_light_and_fast():
    """No torch/ray/deepspeed in a fresh interpreter (torch alone takes seconds to import)."""
    seen, _ = run_light(["plan", str(EXPERIMENT), "--json"])
    assert seen["rc"] == 0 and seen["heavy"] == []


def test_bad_input_subprocess_has_no_traceback(tmp_path):
    path = write_experiment(tmp_path, "neg", lambda d: d["budget"].update(max_dollars=-1))
    proc = subprocess.run(
        [sys.executable, "-m", "service", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"error: {path}: budget.max_dollars: Input should be greater than 0"


def test_plan_ranks_the_engines_the_experiment_lists(tmp_path, capsys):
    path = write_experiment(tmp_path, "engines", lambda d: d.update(engines=["megatron", "fsdp"]))
    assert main(["plan", str(path), "--top", "100000", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    engines = {r["plan"]["engine"] for r in ranked}
    assert engines == {"megatron", "fsdp"}  # no deepspeed plan: the experiment did not list it
    assert main(["plan", str(path), "--engines", "deepspeed", "--top", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plans_evaluated"] == 2730 and {r["plan"]["engine"] for r in data["ranked"]} == {"deepspeed"}
    assert main(["plan", str(path), "--engines", "torch"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--engines" in err and "allowed: deepspeed, fsdp" in err


def test_quantized_collectives_are_tried_only_when_the_experiment_allows_them(tmp_path, capsys):
    path = write_experiment(tmp_path, "q", lambda d: d.update(quantized_collectives=True))
    assert main(["plan", str(path), "--top", "4000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plans_evaluated"] == 2730 + 432  # hpZ + qwZ + qgZ and qwZ + qgZ on ZeRO-3 rows
    quantized = [r for r in data["ranked"] if r["plan"]["zero_quantized_gradients"]]
    assert quantized and all(r["plan"]["zero_quantized_weights"] for r in quantized)
    assert main(["plan", str(write_experiment(tmp_path, "plain", lambda d: None)), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans_evaluated"] == 2730


def test_run_and_report_refuse_a_file_given_as_the_output_folder(tmp_path, capsys):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    assert main(["run", str(EXPERIMENT), "--no-proxies", "--json", "--out", str(a_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == f"error: --out: {a_file} is a file, not a folder"
