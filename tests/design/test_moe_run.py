"""`run` on the MoE experiment (experiments/qwen3-30b-a3b-64xh100.yaml), planned on the prior alone: the
memo says why this EP, what the all-to-all costs, and how the choice moves with the load imbalance."""

from __future__ import annotations

from pathlib import Path

import pytest

from service import Run
from service.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "experiments" / "qwen3-30b-a3b-64xh100.yaml"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "out"
    return Run(EXPERIMENT, storage_path=out, run_proxies=False).fit()


def test_the_choice_is_an_expert_parallel_plan_with_its_families(moe_run):
    x = moe_run.experts
    assert x is not None and moe_run.selected_plan.ep == x.ep
    assert f"-ep{x.ep}-" in moe_run.selected_label or x.ep == 1
    degrees = [f.ep for f in x.families]
    assert len(degrees) == len(set(degrees)) >= 3 and x.ep in degrees
    # Families are ordered best first; an EP spanning nodes pays its all-to-all across the network.
    speeds = [f.tokens_per_s for f in x.families]
    assert speeds == sorted(speeds, reverse=True)
    by_ep = {f.ep: f for f in x.families}
    assert by_ep[16].all_to_all_share > 2 * by_ep[8].all_to_all_share


def test_the_choice_slows_as_the_load_imbalance_grows(moe_run):
    cases = moe_run.experts.imbalance
    assert [c.imbalance for c in cases] == [1.0, 1.5, 2.0]
    speeds = [c.chosen_tokens_per_s for c in cases]
    assert speeds[0] > speeds[1] > speeds[2]
    assert speeds[1] == pytest.approx(moe_run.rows[0].tokens_per_s.value, rel=0.35)


def test_the_memo_has_the_expert_section(moe_run):
    text = (Path(moe_run.out_dir) / "memo.md").read_text()
    assert "## Expert parallelism" in text and "all-to-all" in text
    # Each EP degree's best plan says how long its MoE blocks wait for the host (costmodel/compute.py
    # `moe_host_floor_s`), as a share of its step.
    assert "| all-to-all | host wait |" in text
    assert all(0.0 <= f.host_wait_share < 1.0 for f in moe_run.experts.families)
    assert f"experts split over ep {moe_run.experts.ep}" in text or moe_run.experts.ep == 1


def test_the_memo_names_the_best_plan_of_the_engines_run_does_not_launch(moe_run):
    """The experiment lists megatron and fsdp too: `run` chooses among DeepSpeed plans, and the memo's
    Decision names the model's best of the others with its numbers against the choice."""
    other = moe_run.other_engines
    assert other is not None and other.engines == ["megatron", "fsdp"] and other.label is not None
    assert not other.label.startswith("deepspeed") and other.tokens_per_s > 0
    assert other.over_chosen == pytest.approx(other.tokens_per_s / moe_run.predicted.tokens_per_s.value)
    text = (Path(moe_run.out_dir) / "memo.md").read_text()
    decision = text.split("## Decision", 1)[1].split("\n## ", 1)[0]
    assert "**Other engines:** the experiment also lists megatron, fsdp" in decision
    assert other.label in decision and f"{other.over_chosen:.2f}× the chosen plan's" in decision


MOE = "{num_experts: 4, experts_per_token: %s, expert_ffn_hidden_size: 128%s}"


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        (MOE % (6, ""), "model.moe.experts_per_token: 6 exceeds num_experts 4"),
        (MOE % (2, ", router: switch"), "model.moe.router: "),
        (MOE % (2, ", router: capacity, capacity_factor: 0.5"), "model.moe.capacity_factor: 0.5 is below 1"),
    ],
)
def test_bad_moe_experiments_are_one_line_and_write_nothing(tmp_path, capsys, moe, message):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad-moe\nmodel:\n  num_layers: 4\n  hidden_size: 256\n  num_attention_heads: 4\n"
        f"  ffn_hidden_size: 512\n  vocab_size: 1000\n  moe: {moe}\n"
        "cluster: {gpu: h100-sxm-80gb, num_nodes: 1}\n"
        "workload: {seq_len: 1024, global_batch_sequences: 16, tokens_to_train: 1.0e8}\n"
    )
    before = set(tmp_path.iterdir())
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert set(tmp_path.iterdir()) == before


def test_a_run_without_proxies_says_so_and_the_launch_script_gives_the_expert_layout(moe_run):
    text = (Path(moe_run.out_dir) / "memo.md").read_text()
    assert "**No proxies ran**: every number above is the model's." in text
    assert moe_run.calibration.status == "not calibrated: no proxies ran"
    launch = (Path(moe_run.out_dir) / "launch.sh").read_text()
    plan = moe_run.selected_plan
    assert f"deepspeed.moe.layer.MoE(num_experts=128, ep_size={plan.ep}, k=8," in launch
    assert "drop_tokens=False (dropless)" in launch


def test_ep_families_faster_on_paper_than_the_choice_are_explained(moe_run):
    chosen = moe_run.predicted.tokens_per_s.value
    faster = [
        f for f in moe_run.experts.families if f.tokens_per_s > chosen and f.label != moe_run.selected_label
    ]
    text = (Path(moe_run.out_dir) / "memo.md").read_text()
    section = text.split("## Expert parallelism", 1)[1].split("\n## ", 1)[0]
    if faster:
        own = moe_run.experts.ep  # a faster plan of the choice's own degree is named as one
        eps = ", ".join(
            f"{f.ep} (another plan of the choice's own degree)" if f.ep == own else str(f.ep) for f in faster
        )
        assert f"The best plans of EP {eps} are faster on paper than the choice" in section
    else:
        assert "faster on paper" not in section
