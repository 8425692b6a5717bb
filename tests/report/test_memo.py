"""The memo from a plan-only run of the 13B / 32×H100 experiment (no Ray, seconds): self-contained HTML,
the same numbers as the JSON, every section, provenance tags; `report` rebuilds it from the folder."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml

from service.report.formats import fmt_dollars, fmt_gib, fmt_hours, fmt_tokens
from service.report.result import RunResult

REPO = Path(__file__).resolve().parents[2]
SECTIONS = (
    "Decision",
    "Alternatives and why each lost",
    "Validation on proxies",
    "Extrapolation distance",
    "Goodput",
    "Ties: what the model cannot tell apart",
    "Evidence behind the number",
    "Sensitivity: what would change the choice",
    "Risks",
    "Assumptions and sources",
    "Outputs",
)


@pytest.fixture(scope="module")
def plan_only(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    from service.design.job import Run

    tmp = tmp_path_factory.mktemp("memo")
    data = yaml.safe_load((REPO / "experiments" / "llama2-13b-32xh100.yaml").read_text())
    data["tracking"] = {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "buffer_dir": str(tmp / "pending")}
    data["alternatives"] = [
        {
            "cluster": {
                "gpu": "a100-sxm-80gb",
                "num_nodes": 4,
                "gpus_per_node": 8,
                "price_per_gpu_hour_usd": 1.8,
            },
            "availability": "reserved, 2 weeks",
        }
    ]
    path = tmp / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return Run(path, storage_path=tmp / "out", run_proxies=False).fit()


def test_html_is_self_contained_with_decoded_charts(plan_only: RunResult) -> None:
    page = Path(plan_only.memo_paths["html"]).read_text()
    srcs = re.findall(r"src='([^']*)'", page)
    assert len(srcs) >= 2 and all(s.startswith("data:image/png;base64,") for s in srcs)
    for s in srcs:
        assert base64.b64decode(s.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in page and "https://" not in page and "<link" not in page


def test_memo_numbers_are_the_json_numbers(plan_only: RunResult) -> None:
    md = Path(plan_only.memo_paths["markdown"]).read_text()
    p = plan_only.predicted
    decision = md.split("## Decision", 1)[1].split("##", 1)[0]
    assert plan_only.selected_label and plan_only.selected_label in decision
    assert p is not None and fmt_tokens(p.tokens_per_s.value) in decision
    lo, hi = p.dollars.interval
    assert f"{fmt_dollars(p.dollars.value)} (80 %: {fmt_dollars(lo)}–{fmt_dollars(hi)})" in decision
    assert fmt_hours(p.hours.value) in decision
    assert fmt_gib(p.memory_per_gpu_bytes.value) + " GiB" in decision
    assert f"{plan_only.goodput.checkpoint_interval_hours:.2f} h" in decision
    assert f"MFU {plan_only.selected.mfu:.1%}" in decision
    network = "The intervals assume that network between nodes" in decision
    assert network is (plan_only.cluster.num_nodes > 1)
    saved = json.loads((Path(plan_only.out_dir) / "result.json").read_text())
    assert saved["predicted"] == p.model_dump(mode="json")
    assert set(saved["predicted"]["tokens_per_s"]) == {"value", "interval", "tag"}


def test_memo_has_every_section_tags_and_gpu_types(plan_only: RunResult) -> None:
    md = Path(plan_only.memo_paths["markdown"]).read_text()
    for section in SECTIONS:
        assert f"## {section}" in md, section
    assert "[prior]" in md  # memory: no proxy ran here
    # Time numbers come from the shipped parameter set, fit on published runs, not from a prior.
    assert "[published fit]" in md and plan_only.predicted is not None
    assert plan_only.predicted.tokens_per_s.tag == "fit on published runs"
    assert "Kokolis et al. 2024" in md and "47.7 days" in md  # the cited rate for 32 GPUs
    assert "### GPU types under the same budget" in md and "a100-sxm-80gb" in md
    assert {a.gpu for a in plan_only.alternatives} == {"h100-sxm-80gb", "a100-sxm-80gb"}
    assert sum(a.outcome == "selected" for a in plan_only.alternatives) == 1
    losers = [r for r in plan_only.rows if r.status not in ("selected",)]
    assert losers and all(r.why for r in losers)


def test_the_seed_memo_states_its_tie_group_evidence_flip_and_budget_margin(plan_only: RunResult) -> None:
    """Issue #32's seed memo: a tie group with the reason the choice won it, no offload plan tied at no
    cost, the nearest published runs beside the number, what would flip the choice, the budget margin."""
    md = Path(plan_only.memo_paths["markdown"]).read_text()
    sel_label = plan_only.selected_label
    assert plan_only.ties is not None and sel_label in plan_only.ties.members
    assert "wins the tie" in plan_only.ties.note and "A/B" in plan_only.ties.note
    offload_rows = [r for r in plan_only.rows if r.plan.offload_params or r.plan.offload_optimizer]
    assert offload_rows and all(r.status != "tied" for r in offload_rows)
    assert all("offloads to host memory" in r.why for r in offload_rows if r.status == "riskier")
    ev = plan_only.evidence
    assert ev is not None and ev.stack == "DeepSpeed ZeRO-3, bf16" and not ev.stack_fitted
    assert ev.nearest and all(line in md for line in ev.nearest)
    assert ev.outside_fit and all(line in md for line in ev.outside_fit)  # runs no parameter was fit on
    assert ev.outside_fit[0].startswith("deepcompile-zero3: 12 runs of llama3-70b")
    sens = plan_only.sensitivity
    assert sens is not None and "GB/s per GPU between nodes" in sens.flip
    assert "deepspeedai/DeepSpeed#7164" in md  # why hpZ lost the tie, with the issue
    assert f"**What would flip it:** {sens.flip}" in md
    assert sens.budget_margin.startswith("over budget (max_dollars) only below") and sens.budget_margin in md
    # the first hour and the real fine-tune are in the outputs, with the commands that run them
    assert re.search(rf"python -m service preflight \S+exp\.yaml --plan {re.escape(sel_label)}` on", md)
    assert "--weights DIR --data FILES" in md
    assert "`--compare tie` also runs the tie group's best plan on paper" in md  # the A/B, runnable


def test_report_command_rebuilds_from_the_folder(
    plan_only: RunResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli.main import main

    assert main(["report", plan_only.out_dir, "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert (tmp_path / "memo.md").read_text() == Path(plan_only.memo_paths["markdown"]).read_text()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_own_script_note_says_what_the_config_needs_from_train_py() -> None:
    from service.report.memo_outputs import own_script_note
    from service.report.result import RunResult
    from service.spec.plan import Plan

    def note(**layout: int) -> str:
        plan = Plan(**{"dp": 32, "micro_batch": 1, "grad_accum": 4, **layout})
        return own_script_note(RunResult.model_construct(selected_plan=plan))

    assert note() == ""  # plain data parallelism: DeepSpeed's dp is the world size
    tp = note(dp=16, tp=2)
    assert "2-way tensor-parallel layers and passes their `mpu`" in tp and "dp = 16 ranks, not all 32" in tp
    assert "4-stage `PipelineModule`" in note(dp=8, pp=4) and "dp = 8 ranks, not all 32" in note(dp=8, pp=4)


def test_plans_left_without_a_proxy_are_listed_with_why(plan_only: RunResult) -> None:
    """`choose`'s notes (an expert-parallel degree whose proxy would repeat one that ran, a family whose
    proxy loses it) are printed under the proxies' table, each as its own item."""
    from service.report.memo import proxies
    from service.report.proxy_records import ProxyChoice

    note = "dp32-ep4 (best ep 4 plan, rank 3): not run: its proxy runs ep 2 on 2 ranks, as ... does"
    design = plan_only.proxy_design.model_copy(
        update={
            "choices": [ProxyChoice(plan="dp32-ep8", proxy="dp2-ep2", why="the choice")],
            "skipped": [note],
        }
    )
    blocks = proxies(plan_only.model_copy(update={"proxy_design": design}))
    at = blocks.index(("p", "Plans that got no proxy of their own, and why:"))
    assert blocks[at + 1] == ("ul", [note])
    assert ("p", "Plans that got no proxy of their own, and why:") not in proxies(plan_only)
