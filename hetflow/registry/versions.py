"""The registered models hetflow owns and the versions it logs into them.

Registries are shared: hetflow registers only into registered models it created (they carry
``OWNER_TAG``). A model is logged as weights and a plain ``tf.Module`` or a TFLite file, never as
code a replica wrote: nothing in the registry runs in this process."""

from __future__ import annotations

import logging
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
from hetflow.pipeline import timing
from mlflow import MlflowClient

log = logging.getLogger("hetflow.registry")

OWNER_TAG, OWNER = "hetflow.created_by", "hetflow"  # set on every registered model hetflow creates
SaveModel = Callable[[Path, Model], None]  # writes a model in MLflow's format to a folder


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
    version a previous try of this run made.

    Every call goes through ``client``, whose store is explicit. A flavor's ``log_model`` would read
    the tracking and registry URIs from MLflow's process-wide state (MLFLOW_TRACKING_URI, else its
    default store in the working directory) while the served checks run in other threads: the
    model is saved to a local folder by the flavor's ``save_model`` (which reads no URI) and its
    files logged, as ``log_model`` does, through the client.

    :param artifact_name: the logged model's name in the run (``model``, ``tflite_model``).
    :param save: writes the model in MLflow's format to a folder, under the ``Model`` given.
    """
    existing = client.search_model_versions(f"name='{name}' and run_id='{run_id}'")
    if existing:
        log.info("run %s already registered %s version %s: re-using it", run_id, name, existing[0].version)
        return existing[0]
    with timing.part("mlflow_io"):
        run = client.get_run(run_id)
        logged = client.create_logged_model(
            run.info.experiment_id, name=artifact_name, source_run_id=run_id, params=run.data.params
        )
        try:
            with tempfile.TemporaryDirectory(prefix="hetflow-model-") as folder:
                local = Path(folder) / "model"
                save(
                    local,
                    Model(
                        artifact_path=logged.artifact_location,
                        model_uuid=logged.model_id,
                        run_id=run_id,
                        model_id=logged.model_id,
                    ),
                )
                client.log_model_artifacts(logged.model_id, str(local))
        except BaseException:
            client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
            raise
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        # The files' location, not ``models:/<model id>``: MLflow's SQL registry resolves that through
        # the process-wide tracking URI, in whichever store that names.
        return client.create_model_version(
            name, source=logged.artifact_location, run_id=run_id, model_id=logged.model_id
        )


def saved_model_saver(saved_model: Path, images: np.ndarray, predict: Callable[[np.ndarray], np.ndarray]) -> SaveModel:
    """The exported SavedModel in MLflow's TensorFlow flavour, as a plain ``tf.Module``: MLflow then
    loads it with ``tf.saved_model.load``, without Keras, so it loads in any process with TensorFlow
    whatever its Keras (a tf_keras model would need TF_USE_LEGACY_KERAS=1).

    :param predict: the exported model's logits (``predictors.saved_model_predictor``), for the signature.
    """

    def save(path: Path, mlflow_model: Model) -> None:
        import tensorflow as tf

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

    return save


def tflite_saver(tflite_path: str, images: np.ndarray, predict: Callable[[np.ndarray], np.ndarray]) -> SaveModel:
    """A TFLite file as a pyfunc model whose code is hetflow's ``tflite_pyfunc.py`` (it needs
    ``ai-edge-litert``, not TensorFlow, where it is loaded)."""

    def save(path: Path, mlflow_model: Model) -> None:
        example = images[:5]
        mlflow.pyfunc.save_model(
            str(path),
            mlflow_model=mlflow_model,
            python_model=str(Path(__file__).with_name("tflite_pyfunc.py")),
            artifacts={"tflite": tflite_path},
            signature=infer_signature(example, predict(example)),
            input_example=example,
            pip_requirements=[f"ai-edge-litert=={version('ai-edge-litert')}", f"numpy=={np.__version__}"],
        )

    return save
