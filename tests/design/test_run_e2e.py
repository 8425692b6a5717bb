"""`run` end to end on tiny-cpu (real Ray Tune proxies, DeepSpeed workers, MLflow), killed once in its
second trial and restarted (tests/design/conftest.py); then `report` rebuilds its memo and
`run --json --no-proxies` prints one JSON document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from service.train.proxy_trial import read_log
from tests.design.conftest import CHECKPOINT_STEP, STEPS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_run_selects_calibrates_and_writes_outputs(tiny_run) -> None:
    r = tiny_run.result
    assert r.selected_plan is not None and r.selected_label
    assert r.predicted is not None
    for v in r.predicted.figures().values():
        assert v.interval[0] <= v.value <= v.interval[1]
    ok = [p for p in r.proxies if p.status == "ok"]
    assert len(r.proxies) == 2 and ok, [(p.proxy_label, p.status, p.reason) for p in r.proxies]
    # tiny-cpu's production cluster is CPU workers: the proxies ran on its device type, so time terms are
    # fitted too (after the memory term)
    assert r.calibration.calibrated and r.calibration.fitted[0] == "activation_memory_scale"
    assert "gemm_efficiency_scale" in r.calibration.fitted and r.calibration.source.startswith("proxies:")
    assert r.predicted is not None and r.predicted.tokens_per_s.tag == "calibrated on proxies"
    from service.design.steps import time_provenance
    from service.spec.params import ModelParams, load_params

    assert time_provenance(False, load_params()) == "fit on published runs"  # the shipped set
    assert time_provenance(False, ModelParams()) == "analytical prior"  # fit on nothing
    err = r.proxy_validation_error.activation_bytes_per_rank
    assert err.calibrated is not None and err.calibrated < 0.10
    ds = json.loads(Path(r.ds_config_path).read_text())
    plan = r.selected_plan
    assert ds["train_micro_batch_size_per_gpu"] == plan.micro_batch
    assert ds["gradient_accumulation_steps"] == plan.grad_accum
    assert ds["zero_optimization"]["stage"] == plan.zero_stage
    assert r.deepspeed_command.startswith("deepspeed ") and r.ds_config_path in r.deepspeed_command
    assert r.launch_command.endswith(f"service train {tiny_run.experiment} --plan {r.selected_label}")
    launch = (tiny_run.out / "launch.sh").read_text()
    assert r.launch_command in launch and r.deepspeed_command in launch
    for path in r.memo_paths.values():
        assert Path(path).is_file()
    saved = json.loads((tiny_run.out / "result.json").read_text())
    assert saved["selected_label"] == r.selected_label and saved["mlflow_run_id"] == r.mlflow_run_id


def test_killed_run_restarted_reruns_no_finished_trial_and_resumes_the_running_one(tiny_run) -> None:
    assert tiny_run.killed_after, "the run was killed before any proxy trial finished"
    for outcome in tiny_run.killed_after:
        assert outcome.stat().st_mtime == tiny_run.mtimes[str(outcome)]  # not written again
        records, restarts = read_log(outcome.parent)
        assert restarts == 0 and records  # its workers started once, in the killed run
    trial_ids = {p.parent.name.removeprefix("trial-") for p in tiny_run.killed_after}
    assert trial_ids <= {p.trial_id for p in tiny_run.result.proxies}
    assert len(list(tiny_run.out.glob("search/*/search_state.json"))) == 1  # one search, continued
    # The trial that was running at the kill started again from its last checkpoint, not from step 0,
    # and ran to the end.
    starts = [json.loads(line) for line in (tiny_run.running / "proxy_log.jsonl").read_text().splitlines()]
    assert [int(r["step"]) for r in starts if r["event"] == "start"] == [0, CHECKPOINT_STEP]
    running = next(p for p in tiny_run.result.proxies if tiny_run.running.name == f"trial-{p.trial_id}")
    records, _ = read_log(tiny_run.running)
    assert running.status == "ok" and [int(r["step"]) for r in records] == list(range(1, STEPS + 1))


def test_mlflow_parent_run_has_trials_memo_and_selected_plan(tiny_run) -> None:
    r = tiny_run.result
    client = MlflowClient(tiny_run.uri)
    parent = client.get_run(r.mlflow_run_id)
    assert parent.data.tags["run.selected_plan"] == r.selected_label
    assert parent.data.metrics["predicted_tokens_per_s"] == pytest.approx(r.tokens_per_s)
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    child_ids = {c.info.run_id for c in children}
    assert {p.mlflow_run_id for p in r.proxies} <= child_ids
    # one child run per trial, the killed run's and the restarted run's records in the same ones
    trials = sorted(c.data.tags["trial_id"] for c in children if "trial_id" in c.data.tags)
    assert trials == sorted(p.trial_id for p in r.proxies)
    names = {a.path for a in client.list_artifacts(r.mlflow_run_id, "run")}
    assert {"run/memo.md", "run/memo.html", "run/ds_config.json", "run/result.json"} <= names


def _report(tiny_run, source: str, out: Path, env: dict[str, str] | None = None) -> None:
    """`service report SOURCE --out OUT` succeeds and rebuilds the tiny run's memo as it was."""
    proc = subprocess.run(
        [sys.executable, "-m", "service", "report", source, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    original = Path(tiny_run.result.memo_paths["markdown"]).read_text()
    assert (out / "memo.md").read_text() == original


def test_report_rebuilds_the_memo_from_the_folder(tiny_run, tmp_path: Path) -> None:
    out = tmp_path / "rebuilt"
    _report(tiny_run, str(tiny_run.out), out)
    assert (out / "memo.html").is_file()


def test_report_rebuilds_the_memo_from_the_mlflow_run_id(tiny_run, tmp_path: Path) -> None:
    env = {**os.environ, "MLFLOW_TRACKING_URI": tiny_run.uri, "TMPDIR": str(tmp_path)}
    _report(tiny_run, tiny_run.result.mlflow_run_id, tmp_path / "from-mlflow", env)
    assert not list(tmp_path.glob("report-*"))  # the downloaded result is not left behind


def test_run_json_is_one_document_with_the_contract_keys(tiny_run, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "service",
            "run",
            str(tiny_run.experiment),
            "--json",
            "--no-proxies",
            "--out",
            str(tmp_path / "plan-only"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    for key in (
        "selected_plan",
        "predicted",
        "proxy_validation_error",
        "memo_paths",
        "ds_config_path",
        "launch_command",
        "mlflow_run_id",
    ):
        assert key in doc
    for key in ("tokens_per_s", "hours", "dollars", "memory_per_gpu_bytes"):
        assert len(doc["predicted"][key]["interval"]) == 2
    assert doc["proxies"] == [] and doc["calibration"]["status"].startswith("not calibrated")
