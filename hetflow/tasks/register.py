"""register: one MLflow run per DAG run, the model registered, and the champion gate.

Every MLflow write of a run happens here, in one process, after training: replicas never talk to
MLflow, so several processes never interleave metrics or clash on params, and training does not
depend on the tracking server being up. A retried task finds the run and the version it already
made (by the Airflow run id) and creates neither twice. The parts are in ``hetflow.registry``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetflow.artifacts.predictors import saved_model_predictor, tflite_predictor
from hetflow.artifacts.saved_model import save_serving_model
from hetflow.data.pipeline import split_head
from hetflow.models.architectures import trained_model
from hetflow.paths import RunPaths, run_paths, write_record
from hetflow.pipeline import timing
from hetflow.pipeline.attempts import attempt, load_spec, reported
from hetflow.records import CompressionRecord, DatasetRecord, EvaluationRecord, ExportRecord
from hetflow.registry import champion, run_record, store, versions
from hetflow.registry.training_key import TRAINING_KEY_TAG
from hetflow.replica.training_json import read_training
from hetflow.serving.server import CHECK_EXAMPLES
from hetflow.spec import RunSpec
from mlflow import MlflowClient

log = logging.getLogger("hetflow.stages")


class TrackingUnavailable(RuntimeError):
    pass


@reported
def register(run_id: str, dag_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Everything to MLflow. MLflow's client retries with backoff (MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR); when the server stays away the task fails saying so, and
    the run's files stay in place for a retry of this task."""
    import requests
    from mlflow.exceptions import MlflowException

    paths = run_paths(run_id)
    try:
        with attempt(paths, "register", run_id, try_number) as receipt:
            record = register_model(load_spec(paths), paths, DatasetRecord.read(paths), dag_id, run_id)
    except (MlflowException, requests.exceptions.RequestException) as error:
        reason = str(error).splitlines()[0][:300]
        raise TrackingUnavailable(
            f"MLflow at {store.tracking_uri()} failed: {reason}; the trained model and every stage's files are kept "
            f"in {paths.root}: retry the register task once MLflow is reachable"
        ) from error
    return {**record, "attempt": receipt}


@dataclass
class Candidate:
    """A version this run registered, on its way through the champion gate."""

    version: Any  # MLflow's ModelVersion
    served_check: Future  # its served check, running beside the run's logging
    test_accuracy: float
    tags: dict[str, str]
    report: str  # the version's description: how it was made


def register_model(
    spec: RunSpec, paths: RunPaths, dataset: DatasetRecord, dag_id: str, airflow_run_id: str
) -> dict[str, Any]:
    """Record the run in MLflow, register the float model and the chosen TFLite variant, serve each
    (infra validation), move the aliases; writes registry.json."""
    # Where replicas write (the run directory's top): read as data, like the training record itself.
    evaluation = EvaluationRecord.read(paths)
    exported, compression = ExportRecord.read(paths), CompressionRecord.read(paths)
    client = timing.TimedClient(store.client())
    name, chosen = spec.registry.model_name, exported.chosen_tflite
    # Refused before anything is written to MLflow.
    for model_name in [name, f"{name}-tflite"] if chosen is not None else [name]:
        versions.own_registered_model(client, model_name, name)
    training = read_training(paths.training, spec, dataset)  # refused before the run, its params or a version
    started = run_record.pipeline_started(paths)
    run_id = store.find_or_create_run(client, dag_id, airflow_run_id, run_record.run_name(spec, started), started)
    # What the served checks compare, and the versions' input examples: the test split's first examples, not all.
    images, _ = split_head(dataset, "test", CHECK_EXAMPLES)
    log_dir = paths.serving
    tags, headline = _version_tags_and_headline(spec, dataset, airflow_run_id)

    if not paths.saved_model.exists():  # export_formats without saved_model: the registry still serves one
        save_serving_model(trained_model(spec, dataset, paths.model), paths.saved_model, dataset)
    # Each served check starts as soon as its version exists, beside the logging that follows.
    with ThreadPoolExecutor(max_workers=2) as pool:
        registrar = _Registrar(client, pool, run_id, images, log_dir)
        float_predict = saved_model_predictor(paths.saved_model)
        report = headline + "- float model: the exported SavedModel (serving_default: raw uint8 images -> logits)"
        candidates = [
            registrar.candidate(
                name,
                "model",
                versions.saved_model_saver(paths.saved_model, images, float_predict),
                float_predict,
                evaluation.test_accuracy,
                tags,
                report,
            )
        ]
        if chosen is not None:
            artifact = exported.artifacts[chosen]
            tflite_name, tflite_predict = f"{name}-tflite", tflite_predictor(Path(artifact.path))
            tflite_tags, report = _tflite_description(spec, exported, compression, headline)
            candidates.append(
                registrar.candidate(
                    tflite_name,
                    "tflite_model",
                    versions.tflite_saver(artifact.path, images, tflite_predict),
                    tflite_predict,
                    artifact.test_accuracy,
                    {**tags, **tflite_tags},
                    report,
                )
            )
        run_record.log_run_record(client, run_id, spec, paths, dataset, training, evaluation, exported)
        table = compression_table(exported)
        models = [
            champion.promote(
                client, spec, c.version, c.test_accuracy, dataset, c.tags, c.served_check, c.report, table, log_dir
            )
            for c in candidates
        ]
    run_record.log_served_checks(client, run_id, models, log_dir)
    client.set_tag(run_id, "registry.gate", models[0]["gate"])
    store.finish_run(client, run_id)
    record = {
        **models[0],
        "models": models,
        # What the train DAG's register task emits an Asset event for (the deploy DAG's schedule).
        "champion_moves": [{"model": m["model_name"], "version": str(m["version"])} for m in models if m["promoted"]],
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": store.tracking_uri(),
    }
    write_record(paths.registry, record)
    log.info("MLflow: %s", store.run_page(store.tracking_uri(), run_id))
    return record


def _version_tags_and_headline(
    spec: RunSpec, dataset: DatasetRecord, airflow_run_id: str
) -> tuple[dict[str, str], str]:
    """What every version of this run is tagged with, and its description's first lines."""
    tags = {
        "airflow.run_id": airflow_run_id,
        "dataset.name": dataset.name,
        "dataset.version": dataset.version,
        "dataset.fingerprint": dataset.fingerprint,
        # What the gate compares before accuracy: a champion of another task is not compared.
        "dataset.input_shape": champion.input_shape_tag(dataset),
        "dataset.classes": str(dataset.num_classes),
        TRAINING_KEY_TAG: dataset.training_key,
        "strategy": spec.cluster.strategy,
        "model": spec.model.architecture,
    }
    headline = (
        f"Trained by Airflow run `{airflow_run_id}` ({spec.cluster.strategy}, {spec.model.architecture}) on "
        f"{dataset.name} {dataset.version}.\n\n"
        f"- dataset: {dataset.name} {dataset.version}, fingerprint `{dataset.fingerprint}`, "
        f"from `{dataset.source_path}`\n"
    )
    return tags, headline


@dataclass
class _Registrar:
    """Registers this run's versions, each version's served check started as soon as it exists."""

    client: MlflowClient
    pool: ThreadPoolExecutor
    run_id: str
    images: Any  # the test split's first CHECK_EXAMPLES raw images, the served checks' input
    log_dir: Path

    def candidate(
        self,
        name: str,
        artifact_name: str,
        save: versions.SaveModel,
        predict,
        test_accuracy: float,
        tags: dict,
        report: str,
    ) -> Candidate:
        version = versions.register_version(self.client, name, self.run_id, artifact_name, save)
        check = champion.start_served_check(self.pool, self.client, version, predict, self.images, self.log_dir)
        return Candidate(version, check, test_accuracy, tags, report)


def _tflite_description(
    spec: RunSpec, exported: ExportRecord, compression: CompressionRecord, headline: str
) -> tuple[dict, str]:
    """The chosen TFLite variant's tags and its version's description."""
    artifact = exported.artifacts[exported.chosen_tflite]
    tags = {
        "variant": artifact.variant,
        "prune": str(spec.compression.prune),
        "target_sparsity": str(compression.target_sparsity or 0.0),  # None: not pruned
        "quantize": artifact.quantize,
        "size_bytes": str(artifact.bytes),
        "size_gzip_bytes": str(artifact.gzip_bytes),
        "sparsity": f"{artifact.sparsity:.4f}",
        "weight_encoding": artifact.encoding,
        **({"int8_method": artifact.int8_method} if artifact.int8_method else {}),
        **versions.latency_tags(compression.litert_latency, artifact.variant),
    }
    report = headline + (
        f"- TFLite variant `{artifact.variant}`: {artifact.bytes} bytes, {artifact.gzip_bytes} "
        f"gzipped, sparsity {artifact.sparsity:.4f}, {artifact.encoding} weight encoding, float model's "
        f"accuracy {exported.float_test_accuracy:.4f}, agreement with it "
        f"{artifact.agreement_with_float:.4f}, latency at batch 1 {artifact.latency_ms:.4f} ms"
    )
    return tags, report


# The compression table's headers, two lines each, and which columns hold numbers (right-aligned,
# so that their digits line up).
_COMPRESSION_HEADERS = (
    ("artifact", ""),
    ("bytes", ""),
    ("gzipped", "bytes"),
    ("test", "accuracy"),
    ("agreement", "w/ float"),
    ("latency", "ms"),
    ("sparsity", ""),
    ("weight", "encoding"),
    ("verdict", ""),
)
_NUMBER_COLUMNS = (False, True, True, True, True, True, True, False, False)
# Under the table on both registered models' pages (the float model's too, where "deployed" read as
# if the float model were): which file the -tflite model's version holds.
LEGEND = (
    "Latency: milliseconds per example at batch 1. chosen: the smallest accepted TFLite file, the one "
    "registered as this run's version of the -tflite model."
)


def compression_table(exported: ExportRecord) -> str:
    """export.json as a fixed-width table in a code block, with each rejected artifact's reason in a
    list below it: what a reviewer compares on the version's page in MLflow.

    Not a Markdown table: MLflow's UI (showdown, then sanitize-html, which drops the cells' alignment)
    renders one with collapsed borders and no cell padding, so its columns run together. A code block
    is shown as written, in a monospace font, and scrolls sideways where it is wider than the page's
    column (95 characters in a 1400 px wide window with MLflow's assistant panel open): the columns
    are two spaces apart, and the reasons stay out of it, where a long one wraps instead of widening
    every row."""
    rows, reasons = [], []
    for name, artifact in exported.artifacts.items():
        if not artifact.accepted:
            verdict = "rejected"
            reasons.append(f"- `{name}` rejected: {artifact.reason}")
        else:
            verdict = "chosen" if name == exported.chosen_tflite else "accepted"
        rows.append(
            [
                name,
                str(artifact.bytes),
                str(artifact.gzip_bytes),
                f"{artifact.test_accuracy:.4f}",
                f"{artifact.agreement_with_float:.4f}",
                f"{artifact.latency_ms:.4f}",
                f"{artifact.sparsity or 0.0:.4f}",  # None: the SavedModel's
                artifact.encoding or "dense",
                verdict,
            ]
        )
    headers = [[header[line] for header in _COMPRESSION_HEADERS] for line in (0, 1)]
    widths = [max(map(len, column)) for column in zip(*headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        aligned = (c.rjust(w) if number else c.ljust(w) for c, w, number in zip(cells, widths, _NUMBER_COLUMNS))
        return "  ".join(aligned).rstrip()

    table = "\n".join(["```", *map(line, headers), *map(line, rows), "```"])
    return "\n\n".join([table, LEGEND, *(["\n".join(reasons)] if reasons else [])])
