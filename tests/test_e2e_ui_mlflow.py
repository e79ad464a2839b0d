"""MLflow as users read hetflow's runs, on the run the trigger form started (tests/ui_stack.py): the
key-metrics chart view first, and the version's compression table with its columns apart.
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote

import pytest
from conftest import wait_for
from playwright.sync_api import expect
from ui_pages import assert_key_metrics_first, close_assistant_panel
from ui_stack import ARTIFACTS, SCREENSHOTS

pytestmark = pytest.mark.slow


def test_mlflow_charts_show_the_key_metrics_first(stack, form_run, form_mlflow_run):
    """The chart view make up links to ("their key metrics") opens hetflow's saved view: its first
    section holds test, validation and training accuracy, then loss, then examples/s; MLflow's own
    Model metrics section (alphabetical, epoch_seconds and export_* first) keeps every other metric."""
    page, _ = form_run
    charts = re.search(r"their key metrics: (\S+)", stack["up_output"])[1]
    assert_key_metrics_first(page, charts, set(form_mlflow_run.data.metrics))
    page.screenshot(path=str(SCREENSHOTS / "mlflow_charts.png"))


# The on-screen boxes of each row's values, found in order in the text of ``root`` after its first
# "Compression", whatever elements hold them (a table's cells or a code block's one text).
_TEXT_BOXES = """(root, rows) => {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const starts = [];
    let text = "";
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        starts.push([text.length, node]);
        text += node.data;
    }
    const at = (index) => {
        const [start, node] = starts.findLast(([start]) => start <= index);
        return [node, index - start];
    };
    let from = text.indexOf("Compression");
    if (from < 0) return null;
    return rows.map((values) => values.map((value) => {
        const start = text.indexOf(value, from);
        if (start < 0) return null;
        const range = document.createRange();
        range.setStart(...at(start));
        const [last, offset] = at(start + value.length - 1);
        range.setEnd(last, offset + 1);
        const box = range.getBoundingClientRect();
        from = start + value.length;
        return {left: box.left, right: box.right, top: box.top};
    }));
}"""


def _assert_columns_apart(description, rows: dict[str, list[str]]) -> None:
    """Each row's values (``rows``: the artifact's name, then its cells) on one line, at least 12 px
    apart, the number columns' right edges lined up, and all of it in view without scrolling."""
    found = description.evaluate(_TEXT_BOXES, list(rows.values()))
    assert found and all(all(row) for row in found), (rows, found)
    shown = description.bounding_box()
    for values, row in zip(rows.values(), found):
        assert max(box["top"] for box in row) - min(box["top"] for box in row) < 2, (values, row)  # one line
        gaps = [right["left"] - left["right"] for left, right in zip(row, row[1:])]
        assert min(gaps) >= 12, (values, gaps)
        assert row[-1]["right"] <= shown["x"] + shown["width"], (values, row[-1], shown)
    for column in range(1, 7):
        edges = [row[column]["right"] for row in found]
        assert max(edges) - min(edges) < 1, (rows, column, edges)
    # Nothing of it hidden behind a sideways scroll (a code block scrolls where it is too wide).
    assert description.evaluate("root => [...root.querySelectorAll('*')].every(e => e.scrollWidth <= e.clientWidth)")


def test_the_versions_compression_table_shows_in_mlflow_with_its_columns_apart(
    stack, form_run, mlflow_client, form_mlflow_run
):
    """On the version's page, every row of the compression table reads on one line, with its values
    clearly apart (MLflow renders a Markdown table's cells with no padding: its values touched), the
    numbers of a column right-aligned, and the whole table in view."""
    page, run = form_run
    [run_dir] = [
        found.parent for found in (stack["home"] / "runs").glob("*/run_id") if found.read_text() == run["dag_run_id"]
    ]
    exported = json.loads((run_dir / "export.json").read_text())
    [version] = mlflow_client.search_model_versions(
        f"name = 'hetflow-digits' and run_id = '{form_mlflow_run.info.run_id}'"
    )
    page.goto(f"{stack['state']['mlflow_url']}/#/models/{version.name}/versions/{version.version}")
    description = page.get_by_test_id("note-editor-preview-content")
    description.get_by_text("Compression (export.json)").wait_for()
    fractions = ("test_accuracy", "agreement_with_float", "latency_ms", "sparsity")
    rows = {  # as export.json holds them: the name, the sizes, four decimals of the rest, the encoding
        name: [name, str(a["bytes"]), str(a["gzip_bytes"]), *(f"{a.get(key, 0.0):.4f}" for key in fractions)]
        + [a.get("encoding", "dense")]
        for name, a in exported["artifacts"].items()
    }
    assert len(rows) >= 2, rows  # the SavedModel and at least one TFLite variant
    _assert_columns_apart(description, rows)
    description.get_by_text("Compression (export.json)").scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOTS / "mlflow_version.png"))


def test_the_airflow_run_and_its_mlflow_run_link_to_each_other(stack, form_run, form_mlflow_run):
    """Each task of the form's Airflow run shows an "MLflow run" button (its Details tab) that opens
    the run's MLflow page; that page's description links back to the Airflow run."""
    page, run = form_run
    state, info = stack["state"], form_mlflow_run.info
    run_page = f"{state['mlflow_url']}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
    mlflow_page = f"{run_page}?workflowType=machine_learning"
    airflow_page = f"{state['airflow_url']}/dags/hetflow_train/runs/{quote(run['dag_run_id'], safe='')}"
    page.goto(f"{airflow_page}/tasks/summarize/details")  # its Details tab holds the extra links
    link = page.get_by_role("link", name="MLflow run")
    expect(link).to_have_attribute("href", mlflow_page)
    page.screenshot(path=str(SCREENSHOTS / "airflow_mlflow_link.png"))
    with page.context.expect_page() as opened:
        link.click()
    mlflow = opened.value
    mlflow.get_by_text(info.run_name).first.wait_for()
    expect(mlflow.get_by_role("link", name="The Airflow run")).to_have_attribute("href", airflow_page)
    mlflow.close()


def test_a_runs_charts_gain_points_in_mlflow_while_it_trains_and_the_run_ends_failed(
    stack, api, browser, mlflow_client
):
    """A run triggered through the REST API trains long enough to watch, then times out in train. The
    page validate_spec gives for watching it (tracking.json's live_page: the experiment's chart view of
    that run alone), opened before the first epoch, shows val_accuracy's chart, and more points on it
    without a reload while Airflow still reports train running (MLflow 3.17.2's run page, opened that
    early, says "No charts in this section" until reloaded). The run then ends FAILED, its curve kept,
    naming the task."""
    conf = {
        "epochs": 1000,
        "strategy": "multi_worker_mirrored",
        "workers": 2,
        "train_timeout_seconds": 120,
        "registered_model": "ui-live-digits",
    }
    response = api.post("/dags/hetflow_train/dagRuns", {"logical_date": None, "conf": conf})
    assert response.status_code == 200, response.text
    dag_run_id = response.json()["dag_run_id"]

    def tracking() -> dict | None:
        for found in (stack["home"] / "runs").glob("*/run_id"):
            if found.read_text() == dag_run_id and (found.parent / "tracking.json").exists():
                return json.loads((found.parent / "tracking.json").read_text())
        return None

    tracked = wait_for(tracking, 180, interval=1)
    assert tracked, "validate_spec recorded no MLflow run"
    run_id = tracked["mlflow_run_id"]
    assert "searchFilter=attributes.run_id" in tracked["live_page"] and run_id in tracked["live_page"]
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "RUNNING", run.info
    assert run.data.tags["airflow.url"].endswith(f"/dags/hetflow_train/runs/{quote(dag_run_id, safe='')}")
    opened_with = len(mlflow_client.get_metric_history(run_id, "val_accuracy"))

    def train_state() -> str:
        return api.get(f"/dags/hetflow_train/dagRuns/{dag_run_id}/taskInstances/train")["state"]

    page = browser.new_page(viewport={"width": 1400, "height": 1600})
    page.goto(tracked["live_page"])
    close_assistant_panel(page)
    page.get_by_text("1 matching run").wait_for(timeout=90_000)  # the page loads slowly beside a training cluster
    page.screenshot(path=str(ARTIFACTS / "mlflow_live_run_opened.png"))

    # MLflow searches the runs again every 30 s and adds the charts of new metrics; a chart draws once
    # in view, its points on its element (plotly's data).
    def points() -> int:
        return max(page.evaluate(_POINTS_OF_CHART, "val_accuracy") or [0])

    first = wait_for(lambda: points() > 0 and points(), 150, interval=2)
    assert first, "no val_accuracy point drawn"
    later = wait_for(lambda: points() > first and train_state() == "running" and points(), 100, interval=2)
    assert later, (first, points(), train_state())
    page.screenshot(path=str(SCREENSHOTS / "mlflow_live_run.png"))
    page.close()
    assert opened_with < later, (opened_with, later)

    finished = api.wait_for_run("hetflow_train", dag_run_id)
    assert finished["state"] == "failed"
    ended = mlflow_client.get_run(run_id)
    assert ended.info.status == "FAILED" and ended.data.tags["failed_task"] == "train"
    assert f"training timed out after {conf['train_timeout_seconds']} s" in ended.data.tags["failure_reason"]
    assert len(mlflow_client.get_metric_history(run_id, "val_accuracy")) >= later


# The points of each chart titled ``name``: from its title up to the card holding a chart, each card
# scrolled into view (a chart is drawn once in view).
_POINTS_OF_CHART = """(name) => [...document.querySelectorAll('*')]
    .filter(e => e.children.length === 0 && e.textContent.trim() === name && e.getClientRects().length)
    .map(title => {
        let card = title;
        while (card && !card.querySelector('.js-plotly-plot')) card = card.parentElement;
        card?.scrollIntoView({block: 'center'});
        return card && card.querySelector('.js-plotly-plot');
    })
    .filter(Boolean)
    .map(chart => (chart.data || []).reduce((most, line) => Math.max(most, (line.x || []).length), 0))"""
