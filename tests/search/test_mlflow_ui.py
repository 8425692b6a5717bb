"""The MLflow UI, served on 127.0.0.1 over the shared search's store and opened in a real headless
chromium, shows the search's parent run with its child runs, and a child run's params and metrics.
Screenshots are kept in `.artifacts/mlflow-ui/` (git-ignored) as the test's artifacts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from service.tracking.server import mlflow_server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "mlflow-ui"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


# True once the page shows a number within 0.05 of `v` (the UI prints metrics with its own rounding).
SHOWS_NUMBER = """v => (document.body.innerText.replace(/,/g, '').match(/\\d+\\.\\d+/g) || [])
    .some(n => Math.abs(parseFloat(n) - v) < 0.05)"""


def _close_assistant(page) -> None:
    """MLflow 3's assistant panel covers a third of the page; close it when it is there."""
    close = page.get_by_role("button", name="Close")
    if close.count():
        close.first.click()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium at {CHROMIUM} (CI setup: apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def test_ui_shows_parent_child_runs_params_and_metrics(tiny_search, browser, tmp_path: Path) -> None:
    result = tiny_search.result
    client = MlflowClient(tiny_search.uri)
    exp_id = client.get_experiment_by_name("tiny-search").experiment_id
    parent = client.get_run(result.mlflow_run_id)
    best = result.best
    assert best is not None
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)

    with mlflow_server(tiny_search.uri, log_path=tmp_path / "mlflow-server.log") as url:
        assert url.startswith("http://127.0.0.1:")
        page = browser.new_page(viewport={"width": 1600, "height": 2400})  # tall: params and metrics in view
        page.set_default_timeout(60_000)
        # MLflow 3 opens in its GenAI view; the "Model training" view lists runs.
        page.goto(f"{url}/#/experiments/{exp_id}/runs?workflowType=machine_learning")
        parent_row = page.locator("[role=row]", has_text=parent.info.run_name[:24]).first
        parent_row.wait_for()
        _close_assistant(page)
        parent_row.locator("button").first.click()  # expand: the child runs appear under the parent
        for trial in result.trials:
            page.get_by_text(f"[{trial.trial_id}]").first.wait_for()
        assert page.get_by_text("pruned dp2-").count() >= 1
        page.screenshot(path=str(ARTIFACTS / "runs.png"))

        page.goto(f"{url}/#/experiments/{exp_id}/runs/{best.mlflow_run_id}?workflowType=machine_learning")
        page.get_by_role("link", name=parent.info.run_name).first.wait_for()  # "Parent run" links back
        page.get_by_text("plan.micro_batch").first.wait_for()
        page.get_by_text("measured_tokens_per_s").first.wait_for()
        # The value itself is on the page (as the UI rounds it): wait for it, since the metric values can
        # render after their names; a value that never shows fails here after the page's timeout.
        tokens = best.measured["tokens_per_s"]
        page.wait_for_function(SHOWS_NUMBER, arg=tokens)
        body = page.inner_text("body")
        assert "predicted_tokens_per_s" in body and "Parent run" in body and parent.info.run_name in body
        page.screenshot(path=str(ARTIFACTS / "child_run.png"), full_page=True)

        page.goto(f"{url}/#/experiments/{exp_id}/runs/{parent.info.run_id}?workflowType=machine_learning")
        page.get_by_text("best_tokens_per_s").first.wait_for()
        assert "num_pruned" in page.inner_text("body")
        page.screenshot(path=str(ARTIFACTS / "parent_run.png"), full_page=True)
        page.close()

    for name in ("runs.png", "child_run.png", "parent_run.png"):
        assert (ARTIFACTS / name).stat().st_size > 20_000
