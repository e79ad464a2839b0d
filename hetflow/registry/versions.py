"""The registered models hetflow owns and the versions it logs into them.

Registries are shared: hetflow registers only into registered models it created (they carry
``OWNER_TAG``). A model is logged as weights and a plain ``tf.Module`` or a TFLite file, never as
code a replica wrote: nothing in the registry runs in this process."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Callable

import numpy as np
from mlflow.entities import LoggedModelOutput, LoggedModelStatus
from mlflow.exceptions import MlflowException
from mlflow.models import Model, infer_signature
from mlflow.protos.databricks_pb2 import ALREADY_EXISTS, RESOURCE_ALREADY_EXISTS, ErrorCode

import mlflow
from hetflow.artifacts import edge_metadata
from hetflow.artifacts.litert_latency import latency_line
from hetflow.pipeline import timing
from hetflow.records import LiteRTLatency
from mlflow import MlflowClient

log = logging.getLogger("hetflow.registry")

OWNER_TAG, OWNER = "hetflow.created_by", "hetflow"  # set on every registered model hetflow creates
# Writes a model in MLflow's format to a folder as the version numbered; returns tags for the version.
SaveModel = Callable[[Path, Model, str], dict[str, str]]


class ForeignRegisteredModel(ValueError):
    """The registered model name belongs to a model hetflow did not create."""


def own_registered_model(client: MlflowClient, name: str, registered_model: str) -> None:
    """Create registered model ``name`` marked as hetflow's, or check that the one there is hetflow's.

    In a shared registry the name may already hold someone else's model: registering into it, and
    comparing against its champion, would mix hetflow's versions with theirs. ``registered_model``
    is the spec's value that chose the name (the TFLite model's name adds ``-tflite`` to it)."""
    try:
        client.create_registered_model(
            name, tags={OWNER_TAG: OWNER}, description=_model_description(name, registered_model)
        )
        return
    except MlflowException as error:
        # Created meanwhile, by an earlier run or a concurrent one (the tag comes with the creation).
        if error.error_code not in (ErrorCode.Name(RESOURCE_ALREADY_EXISTS), ErrorCode.Name(ALREADY_EXISTS)):
            raise
    if client.get_registered_model(name).tags.get(OWNER_TAG) != OWNER:
        raise ForeignRegisteredModel(
            f"registered_model {registered_model!r}: the registered model {name!r} in {client.tracking_uri} was not "
            f"created by hetflow (no tag {OWNER_TAG}={OWNER}); choose another registered_model"
        )


def _model_description(name: str, registered_model: str) -> str:
    """What a registered model holds, on its page in MLflow (each version says how it was made)."""
    if name == registered_model:
        kind = "the float model: the SavedModel every run exports, served from raw uint8 images to logits"
    else:
        kind = (
            f"the TFLite file chosen from each run's compressed variants (pruned and/or quantized), beside the "
            f"float model `{registered_model}`"
        )
    return (
        f"Trained by hetflow: {kind}. Each version is one run (its MLflow run, dataset and fingerprint, test "
        "accuracy against the champion's, the served check and the gate's decision are in its description). "
        "Aliases: `candidate`, the newest version; `champion`, the version that beat the one before by at least "
        "the run's min_improvement."
    )


def register_version(client: MlflowClient, name: str, run_id: str, artifact_name: str, save: SaveModel):
    """Log a model into run ``run_id`` and register it as a new version of ``name``, or return the
    version a previous try of this run made (its files logged again where that try stopped first).

    Every call goes through ``client``, whose store is explicit. A flavor's ``log_model`` would read
    the tracking and registry URIs from MLflow's process-wide state (MLFLOW_TRACKING_URI, else its
    default store in the working directory) while the served checks run in other threads: the
    model is saved to a local folder by the flavor's ``save_model`` (which reads no URI) and its
    files logged, as ``log_model`` does, through the client. The version is created before its files
    are logged: its number goes into them (a TFLite file's metadata says which version it is).

    :param artifact_name: the logged model's name in the run (``model``, ``tflite_model``).
    :param save: writes the model in MLflow's format to a folder, under the ``Model`` given, as the
        version numbered; returns tags for the version.
    """
    existing = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    with timing.part("mlflow_io"):
        run = client.get_run(run_id)
        if existing:
            version, logged = existing[0], _logged_model_of(client, existing[0], run)
            if logged.status == LoggedModelStatus.READY:
                log.info("run %s already registered %s version %s: re-using it", run_id, name, version.version)
                return version
        else:
            logged = client.create_logged_model(
                run.info.experiment_id, name=artifact_name, source_run_id=run_id, params=run.data.params
            )
            # The files' location, not ``models:/<model id>``: MLflow's SQL registry resolves that through
            # the process-wide tracking URI, in whichever store that names.
            version = client.create_model_version(
                name, source=logged.artifact_location, run_id=run_id, model_id=logged.model_id
            )
        try:
            with tempfile.TemporaryDirectory(prefix="hetflow-model-") as folder:
                local = Path(folder) / "model"
                mlflow_model = Model(
                    artifact_path=logged.artifact_location,
                    model_uuid=logged.model_id,
                    run_id=run_id,
                    model_id=logged.model_id,
                )
                tags = save(local, mlflow_model, str(version.version))
                client.log_model_artifacts(logged.model_id, str(local))
        except BaseException:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        for key, value in tags.items():
            client.set_model_version_tag(name, version.version, key, value)
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        return client.get_model_version(name, version.version)


def _logged_model_of(client: MlflowClient, version, run):
    """The logged model whose files ``version`` points at (the SQL registry keeps no model id on a version)."""
    logged = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")
    found = [model for model in logged if model.artifact_location == version.source]
    if not found:
        raise LookupError(
            f"version {version.version} of {version.name}: no logged model of run {run.info.run_id} at {version.source}"
        )
    return found[0]


def saved_model_saver(saved_model: Path, images: np.ndarray, predict: Callable[[np.ndarray], np.ndarray]) -> SaveModel:
    """The exported SavedModel in MLflow's TensorFlow flavour, as a plain ``tf.Module``: MLflow then
    loads it with ``tf.saved_model.load``, without Keras, so it loads in any process with TensorFlow
    whatever its Keras (a tf_keras model would need TF_USE_LEGACY_KERAS=1).

    :param predict: the exported model's logits (``predictors.saved_model_predictor``), for the signature.
    """

    def save(path: Path, mlflow_model: Model, registered_version: str) -> dict[str, str]:
        import tensorflow as tf

        from hetflow.artifacts.saved_model import WARMUP_FILE

        exported = tf.saved_model.load(str(saved_model))
        serve = exported.signatures["serving_default"]

        class Logits(tf.Module):
            """MLflow's pyfunc calls the module: ``__call__`` is serving_default's logits."""

            def __init__(self):
                super().__init__()
                self.exported = exported  # tracked, so its variables are saved
                self.__call__ = tf.function(
                    lambda image: serve(image=image)["logits"],
                    input_signature=[serve.structured_input_signature[1]["image"]],
                )

        example = images[:5]
        mlflow.tensorflow.save_model(
            Logits(),
            str(path),
            mlflow_model=mlflow_model,
            # TF Serving and tf.saved_model.load users keep the export's signature (uint8 image -> logits).
            saved_model_kwargs={"signatures": {"serving_default": serve}},
            signature=infer_signature(example, predict(example)),
            input_example=example,
            pip_requirements=[f"tensorflow=={version('tensorflow')}", f"numpy=={np.__version__}"],
        )
        # TF Serving's warm-up requests fit the re-saved model too: its serving_default is the export's.
        if (saved_model / WARMUP_FILE).exists():
            shutil.copytree(saved_model / WARMUP_FILE.parent, path / "tf2model" / WARMUP_FILE.parent)
        return {}

    return save


def tflite_saver(tflite_path: str, images: np.ndarray, predict: Callable[[np.ndarray], np.ndarray]) -> SaveModel:
    """A TFLite file as a pyfunc model whose code is hetflow's ``tflite_pyfunc.py`` (it needs
    ``ai-edge-litert``, not TensorFlow, where it is loaded). The registered file's metadata says the
    version it is registered as; the version's edge tags (``EDGE_TAGS``) are that file's."""

    def save(path: Path, mlflow_model: Model, registered_version: str) -> dict[str, str]:
        example = images[:5]
        with tempfile.TemporaryDirectory(prefix="hetflow-tflite-") as folder:
            registered = Path(folder) / Path(tflite_path).name
            registered.write_bytes(edge_metadata.with_version(Path(tflite_path).read_bytes(), registered_version))
            mlflow.pyfunc.save_model(
                str(path),
                mlflow_model=mlflow_model,
                python_model=str(Path(__file__).with_name("tflite_pyfunc.py")),
                artifacts={"tflite": str(registered)},
                signature=infer_signature(example, predict(example)),
                input_example=example,
                pip_requirements=[f"ai-edge-litert=={version('ai-edge-litert')}", f"numpy=={np.__version__}"],
            )
        return edge_tags(path, f"artifacts/{registered.name}")

    return save


# A TFLite version's file as a device fetches it (``hetflow.serving.edge``): its path in the version's
# files, sha256, size and metadata (``edge_metadata.summary``, JSON).
EDGE_TAGS = {"file": "edge.file", "sha256": "edge.sha256", "size_bytes": "edge.size_bytes", "metadata": "edge.metadata"}
LATENCY_TAG = "litert.latency_ms"  # the registered file's; LATENCY_TAG.<variant> each variant's


def edge_tags(model_folder: Path, file: str) -> dict[str, str]:
    """The edge tags of the TFLite file at ``file`` in the MLflow model saved at ``model_folder``."""
    data = (model_folder / file).read_bytes()
    return {
        EDGE_TAGS["file"]: file,
        EDGE_TAGS["sha256"]: hashlib.sha256(data).hexdigest(),
        EDGE_TAGS["size_bytes"]: str(len(data)),
        EDGE_TAGS["metadata"]: json.dumps(edge_metadata.summary(edge_metadata.read_metadata(data))),
    }


def latency_tags(latency: dict[str, LiteRTLatency] | None, variant: str) -> dict[str, str]:
    """The TFLite version's latency tags: ``variant``'s (the registered file's) and every variant's of
    the run, as compress measured them (none for a run compressed before it measured)."""
    lines = {name: latency_line(figures) for name, figures in (latency or {}).items()}
    return {
        **({LATENCY_TAG: lines[variant]} if variant in lines else {}),
        **{f"{LATENCY_TAG}.{name}": line for name, line in lines.items()},
    }
