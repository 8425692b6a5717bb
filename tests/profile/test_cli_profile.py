"""`python -m service profile`: one JSON document, the files it writes, and one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.cli.main import main
from service.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
TINY_EXPERIMENT = str(ROOT / "experiments" / "tiny-cpu.yaml")


def test_json_is_one_document_and_the_profile_and_catalog_entry_are_written(capsys, tmp_path, monkeypatch):
    import service.profile.catalog as catalog

    monkeypatch.setattr(catalog, "CATALOG_GPUS", tmp_path / "gpus")  # never touch the real catalog
    out = tmp_path / "cpu.yaml"
    argv = [
        "profile",
        "--experiment",
        TINY_EXPERIMENT,
        "--device",
        "cpu",
        "--budget-s",
        "2",
        "--workers",
        "0",
    ]
    assert main([*argv, "--json", "--out", str(out), "--write-catalog", "cpu-cli-test"]) == 0
    data = json.loads(capsys.readouterr().out)  # the whole of stdout parses as one document
    assert data["profile_path"] == str(out) and data["device"]["kind"] == "cpu"
    assert data["model"] == "tiny-llama-proxy" and data["overrides"]["kernel_overhead_us"] > 0
    assert load_profile(out).overrides == data["overrides"]
    entry = Path(data["catalog_entry_path"])
    assert entry == tmp_path / "gpus" / "cpu-cli-test.yaml" and "# measured" in entry.read_text()


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--model", "no-such-model"], "model"),
        (["--budget-s", "0"], "--budget-s"),
        (["--budget-s", "-5"], "--budget-s"),
        (["--threads", "0"], "--threads"),
        (["--workers", "1"], "--workers"),
        (["--experiment", "no/such.yaml"], "path"),
    ],
)
def test_bad_input_is_one_line_naming_the_field_and_exit_2(capsys, flags, field):
    assert main(["profile", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and field in err and "Traceback" not in err


def test_cuda_requested_without_a_gpu_is_a_one_line_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["profile", "--device", "cuda", "--budget-s", "1"]) == 2
    assert "--device" in capsys.readouterr().err
