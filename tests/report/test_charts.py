"""The memo's charts for plan-only runs of tiny-cpu and the 13B / 32×H100 seed (seconds each, no Ray):
the PNGs are drawn, and the numbers they draw are the run's numbers: one bar per strategy family with
its best plan's intervals, memory totals that are the sums of their terms, and proxy words that say
what CPU proxies check (layouts build; memory terms), never that they validated speed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.report.charts import draw_all, proxy_chart
from service.report.charts_data import GIB, TERMS, family_bars, memory_bars, proxy_text
from service.report.memo import proxies as proxy_blocks
from service.report.result import Interval, PlanRow, ProxyTrial, RunResult
from service.spec.workload import Budget

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"
MIB = 2**20


def _plan_only(tmp: Path, experiment: str) -> RunResult:
    from service.design.job import Run

    data = yaml.safe_load((REPO / "experiments" / experiment).read_text())
    data["tracking"] = {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "buffer_dir": str(tmp / "pending")}
    path = tmp / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return Run(path, storage_path=tmp / "out", run_proxies=False).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunResult]:
    return {
        name: _plan_only(tmp_path_factory.mktemp(name), f"{experiment}.yaml")
        for name, experiment in (("tiny", "tiny-cpu"), ("seed", "llama2-13b-32xh100"))
    }


def _with_cpu_proxies(r: RunResult) -> RunResult:
    """The run as if two CPU proxies had run (one built and stepped, one did not)."""

    def trial(label: str, status: str, act: float, state: float) -> ProxyTrial:
        measured = {"activation_bytes_per_rank": act * MIB, "model_state_bytes_per_rank": state * MIB}
        measured |= {"tokens_per_s": 900.0} if status == "ok" else {}
        return ProxyTrial.model_validate(
            {
                "trial_id": label,
                "production_label": r.rows[0].label,
                "proxy_label": label,
                "proxy_plan": {},
                "status": status,
                "measured": measured if status == "ok" else {},
                "predicted_prior": {
                    "activation_bytes_per_rank": act * 1.1 * MIB,
                    "model_state_bytes_per_rank": state * 0.9 * MIB,
                    "tokens_per_s": 1000.0,
                },
                "predicted_calibrated": {"activation_bytes_per_rank": act * 1.02 * MIB},
            }
        )

    return r.model_copy(
        update={
            "proxies": [
                trial("dp2-tp1-pp1-z3-mb1-ga4-rc:none", "ok", 120.0, 40.0),
                trial("dp1-tp2-pp1-z1-mb1-ga8-rc:none", "failed", 0.0, 0.0),
            ],
            "proxy_design": r.proxy_design.model_copy(update={"device": "cpu", "gpu": "cpu"}),
        }
    )


@pytest.mark.parametrize("name", ["tiny", "seed"])
def test_charts_are_drawn(runs: dict[str, RunResult], name: str, tmp_path: Path) -> None:
    charts = draw_all(runs[name], tmp_path)
    assert {"families", "memory", "cost_vs_throughput"} <= set(charts)
    for path in charts.values():
        data = path.read_bytes()
        assert data[:8] == PNG and len(data) > 10_000, path
    with_proxies = draw_all(_with_cpu_proxies(runs[name]), tmp_path / "proxies")
    assert with_proxies["proxies"].read_bytes()[:8] == PNG


@pytest.mark.parametrize("name", ["tiny", "seed"])
def test_one_bar_per_family_with_its_best_plans_intervals(runs: dict[str, RunResult], name: str) -> None:
    r = runs[name]
    chart = family_bars(r)
    # Every family is named on exactly one bar; a plan that is several families' best is one bar.
    named = [f for b in chart.bars for f in b.family.split(" · ")]
    assert sorted(named) == sorted({f for row in r.rows for f in row.families})
    assert len({b.label for b in chart.bars}) == len(chart.bars)
    by_label = {row.label: row for row in r.rows}
    selected = r.selected
    assert selected is not None
    for bar in chart.bars:
        row = by_label[bar.label]
        assert bar.status == row.status
        assert bar.hours == row.hours and bar.dollars == row.dollars  # value, low and high
        for family in bar.family.split(" · "):
            assert family in row.families
            if family in selected.families:
                assert bar.selected and bar.label == selected.label
            else:
                ranks = [x.rank for x in r.rows if family in x.families and x.rank is not None]
                assert row.rank == min(ranks)
    assert chart.max_hours == r.budget.max_hours and chart.max_dollars == r.budget.max_dollars


def test_family_bar_is_the_selected_plan_else_the_best_ranked(runs: dict[str, RunResult]) -> None:
    base = runs["seed"].rows[0]

    def row(label: str, status: str, rank: int | None, families: list[str], hours: float) -> PlanRow:
        iv = Interval(value=hours, low=hours * 0.8, high=hours * 1.3)
        return base.model_copy(
            update={"label": label, "status": status, "rank": rank, "families": families, "hours": iv}
        )

    rows = [
        row("a", "selected", 2, ["x"], 3.0),  # the choice stands for its family even when not rank 1
        row("b", "less robust", 1, ["x", "y"], 2.5),
        row("c", "costlier", 4, ["y"], 4.0),
        row("d", "over memory", None, ["z"], 1.0),  # unranked: only when nothing else is in its family
    ]
    r = runs["seed"].model_copy(update={"rows": rows, "budget": Budget(max_hours=24.0)})
    chart = family_bars(r)
    assert [(b.family, b.label) for b in chart.bars] == [("x", "a"), ("y", "b"), ("z", "d")]
    merged = family_bars(r.model_copy(update={"rows": [row("a", "selected", 1, ["x", "y"], 3.0)]}))
    assert [(b.family, b.label) for b in merged.bars] == [("x · y", "a")]
    assert chart.bars[0].selected and not chart.bars[1].selected
    assert chart.bars[1].hours.interval == (2.0, 3.25)
    assert (chart.max_hours, chart.max_dollars) == (24.0, None)


def test_memory_totals_are_the_sums_of_their_terms(runs: dict[str, RunResult]) -> None:
    for r in runs.values():
        chart = memory_bars(r)
        assert chart is not None and [b.label for b in chart.bars] == [row.label for row in r.rows]
        for bar, row in zip(chart.bars, r.rows, strict=True):
            assert list(bar.terms) == list(TERMS)
            assert bar.total == pytest.approx(sum(bar.terms.values()))
            assert bar.total * GIB == pytest.approx(sum(row.memory_breakdown[t] for t in TERMS))
            assert bar.total * GIB == pytest.approx(row.memory_per_gpu_bytes.value, rel=1e-9)
            assert (bar.low, bar.high) == (
                row.memory_per_gpu_bytes.low / GIB,
                row.memory_per_gpu_bytes.high / GIB,
            )
            assert bar.host * GIB == row.memory_breakdown.get("cpu_offload", 0.0)
        assert chart.limit * GIB == r.rows[0].memory_limit_bytes
        assert chart.device_memory * GIB == r.rows[0].hbm_bytes
    seed = memory_bars(runs["seed"])
    assert seed is not None and seed.bars[0].selected and not any(b.selected for b in seed.bars[1:])


def test_cpu_proxies_are_never_said_to_validate_speed(runs: dict[str, RunResult], tmp_path: Path) -> None:
    r = _with_cpu_proxies(runs["seed"])  # CPU proxies for an H100 cluster
    words = proxy_text(r)
    assert not any("validated" in w.lower() for w in words.words())
    assert "layout builds" in words.title and "memory terms" in words.title
    assert "1 of 2 proxy layouts built and stepped" in words.built
    assert "gloo" in words.note and "NVLink" in words.note
    assert proxy_chart(r, tmp_path / "p.png") is not None

    blocks = proxy_blocks(r)
    tables = [b for b in blocks if b[0] == "table" and b[1][0] == "proxy"]
    assert len(tables) == 1 and not any("tokens/s" in h for h in tables[0][1])
    assert all(len(row) == len(tables[0][1]) for row in tables[0][2])
    text = " ".join(str(b[1]) for b in blocks if b[0] == "p")
    assert "No tokens/s column" in text and "gloo" in text and "GPU kernels" in text
    captions = [b[2] for b in blocks if b[0] == "img"]
    assert captions and not any("validated" in c.lower() for c in captions)


def test_cpu_proxies_of_a_cpu_cluster_keep_their_speed(runs: dict[str, RunResult]) -> None:
    """On a CPU cluster the proxies ran on the production device: their tokens/s is the speed."""
    r = _with_cpu_proxies(runs["tiny"])
    words = proxy_text(r)
    assert not any("validated" in w.lower() for w in words.words())
    table = next(b for b in proxy_blocks(r) if b[0] == "table" and b[1][0] == "proxy")
    assert table[1][-1] == "tokens/s measured / prior" and table[2][0][-1] == "900 / 1,000"
