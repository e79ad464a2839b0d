"""The saved view of hetflow's experiment in MLflow's UI that puts the figures a reviewer compares
first: a *Key metrics* section of charts (test, validation and training accuracy, then loss, then
examples/s) above MLflow's own *Model metrics* section, which keeps every other metric; and in the
runs table, test accuracy, training seconds and examples/s beside each run's name.

MLflow 3.17 orders the charts of its chart view by name within a section, and the sections by the
part of a metric's name before ``/`` (``epoch_seconds`` and ``export_*`` come first). Renaming the
metrics would change what tests and users read; the UI keeps a chart layout a user arranges in the
browser only. The one layout it reads from the tracking server is a saved view: an experiment tag
``mlflow.sharedViewState.<id>`` holding ``{"name", "createdAt", "updatedAt", "state"}``, ``state``
being the page's state as JSON, which the UI lists under *Views* and opens from
``?viewStateShareKey=<id>``. A run's own *Model metrics* tab reads no view (browser storage only).
"""

from __future__ import annotations

import json
import time

VIEW_ID = "hetflow-key-metrics"
VIEW_NAME = "Key metrics first"
TAG = f"mlflow.sharedViewState.{VIEW_ID}"

KEY_METRICS_SECTION = "Key metrics"
# In the chart grid's rows (three charts a row): accuracy, loss, speed. The per-epoch series are
# line charts; one value per run, a bar chart (the UI makes a chart a line once it has steps).
KEY_METRICS = (
    "test_accuracy",
    "val_accuracy",
    "train_accuracy",
    "test_loss",
    "val_loss",
    "train_loss",
    "examples_per_second",
)
_PER_EPOCH = {"val_accuracy", "train_accuracy", "val_loss", "train_loss"}
# The runs table's columns beside each run's name and start (keys ``<type>.`<name>```), at their
# widths (px): what tells two runs apart first, test accuracy, and how long and how fast they
# trained; then the versions it registered and the aliases they hold (the tag
# ``run_record.tag_registered`` writes: MLflow's own Models column names the versions only); then
# where it came from (the same DAG for most runs, so last, where a 1400 px window may scroll to it).
# No Dataset column: it pushed the metrics out of view.
COLUMNS = {
    "metrics.`test_accuracy`": 105,
    "metrics.`train_seconds`": 105,
    "metrics.`examples_per_second`": 150,
    "tags.`registered`": 330,
    "attributes.`Source`": 210,
}
# The columns MLflow always shows, first, at widths that show a run's whole name (MLflow's default
# cut names to the same "uci_digits one-device 1w…", hiding what told them apart); with COLUMNS
# up to the registered versions, within 1400 px.
_LEADING_COLUMNS = {"attributes.`Run Name`": 270, "runDateAndNestInfo": 130, "duration": 80}


def _chart(metric: str, section: str) -> dict:
    """A chart card as MLflow's UI writes one (RunsChartsCardConfig), marked generated so that the
    UI may still turn a bar into a line."""
    card = {
        "uuid": f"{VIEW_ID}-{metric}",
        "metricSectionId": section,
        "runsCountToCompare": 10,
        "deleted": False,
        "isGenerated": True,
        "metricKey": metric,
        "displayName": metric,
    }
    if metric not in _PER_EPOCH:
        return {**card, "type": "BAR"}
    return {
        **card,
        "type": "LINE",
        "lineSmoothness": 0,
        "xAxisScaleType": "linear",
        "scaleType": "linear",
        "range": {},
        "xAxisKey": "step",
        "selectedXAxisMetricKey": "",
        "yAxisKey": "metric",
        "yAxisExpressions": [],
        "ignoreOutliers": False,
        "useGlobalXaxisKey": True,
        "useGlobalLineSmoothing": True,
    }


def _section(name: str, uuid: str, reordered: bool) -> dict:
    return {"uuid": uuid, "name": name, "display": True, "isReordered": reordered, "deleted": False}


def state() -> dict:
    """The page state the view restores: the key charts in their own section, first. The UI adds a
    chart for every other metric to *Model metrics* as it finds them (a reordered section would
    only append, so *Key metrics* keeps this order)."""
    key, model, system = (f"{VIEW_ID}-section-{n}" for n in ("key", "model", "system"))
    return {
        "compareRunCharts": [_chart(metric, key) for metric in KEY_METRICS],
        "compareRunSections": [
            _section(KEY_METRICS_SECTION, key, reordered=True),
            _section("Model metrics", model, reordered=False),
            _section("System metrics", system, reordered=False),
        ],
        "isAccordionReordered": True,  # the sections stay in this order
        "hideEmptyCharts": True,
        "selectedColumns": list(COLUMNS),
        "columnOrder": [*_LEADING_COLUMNS, *COLUMNS],
        "columnWidths": {**_LEADING_COLUMNS, **COLUMNS},
    }


def tag_value(now: float | None = None) -> str:
    created = int((time.time() if now is None else now) * 1000)
    return json.dumps(
        {"name": VIEW_NAME, "createdAt": created, "updatedAt": created, "state": json.dumps(state(), sort_keys=True)}
    )


def is_current(value: str | None) -> bool:
    """Whether a tag holds this version's view (its time of writing aside)."""
    try:
        envelope = json.loads(value or "")
        return envelope["name"] == VIEW_NAME and json.loads(envelope["state"]) == state()
    except (ValueError, KeyError, TypeError):
        return False
