"""The run's HTML memo opened in a real headless Chromium: it renders, its charts are there and decoded,
and the numbers on the page are the numbers of the run's JSON. Screenshot kept in
`.artifacts/run-memo/` (git-ignored) as the test's artifact."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.report.formats import fmt_dollars, fmt_gib, fmt_hours, fmt_tokens

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "run-memo"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def test_memo_renders_with_charts_and_the_json_numbers(tiny_run) -> None:
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (CI setup: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    r = tiny_run.result
    page_path = Path(r.memo_paths["html"])
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 2000})
            page.goto(page_path.as_uri())
            assert page.locator("h1").inner_text() == f"Design memo: {r.experiment}"
            for chart in ("memory", "cost_vs_throughput", "proxies"):
                img = page.locator(f"img#chart-{chart}")
                assert img.count() == 1, chart
                width = img.evaluate("i => i.complete ? i.naturalWidth : 0")
                assert width > 100, f"chart {chart} did not decode"
            decision = page.locator("h2:text('Decision') + p").inner_text()
            pred = r.predicted
            assert pred is not None and r.selected_label in decision
            assert fmt_tokens(pred.tokens_per_s.value) in decision
            assert fmt_hours(pred.hours.value) in decision
            assert fmt_dollars(pred.dollars.value) in decision
            mem = pred.memory_per_gpu_bytes
            assert f"{fmt_gib(mem.value)} GiB" in decision
            assert f"{fmt_gib(mem.interval[0])}–{fmt_gib(mem.interval[1])} GiB" in decision
            body = page.inner_text("body")
            for proxy in r.proxies:
                assert proxy.proxy_label in body
            assert "Young/Daly" in body and "Sensitivity" in body and "Risks" in body
            page.screenshot(path=str(ARTIFACTS / "memo.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "memo.png").stat().st_size > 10_000
