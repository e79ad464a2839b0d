"""Registered versions for the endpoint's tests and bench: small Keras digit models saved as hetflow
saves them (MLflow's TensorFlow flavor, the export's uint8 ``image`` -> ``logits`` signature), and
two kinds of bad candidate, real models whose graph misbehaves as a bad release does: one that fails
on a share of requests, one that is slow.

Versions are registered from a folder (``create_model_version(source=...)``), as MLflow registers a
model logged elsewhere; nothing is faked: the model servers load and run these graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SHAPE = (8, 8, 1)


def sample_images(count: int = 16, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, *IMAGE_SHAPE), dtype=np.uint8)


def load_images(count: int = 200) -> list:
    """The images a steady load cycles through: others than the input examples'."""
    return sample_images(count, seed=11).tolist()


def _pixel_sums(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).astype(np.int64).sum(axis=1)


def save_version(
    folder: Path, seed: int, fault: str | None = None, failing_share: float = 0.05, slow_loop: int = 3000
) -> np.ndarray:
    """A model saved to ``folder``; returns its logits on ``sample_images()``.

    :param fault: None; "errors": the graph fails (an assertion, answered 500) on about
        ``failing_share`` of the images (those whose pixel sum is a multiple of 1/share), as a release
        that breaks on some inputs does, but not on the input example MLflow keeps with it (the
        rollout's warm-up passes); "slow": the graph runs a loop of ``slow_loop`` dense layers before answering.
    """
    import tensorflow as tf
    from mlflow.models import infer_signature

    import mlflow
    from hetflow.models.architectures import build_model

    model = build_model("mlp", list(IMAGE_SHAPE), 10, seed=seed)
    images = sample_images()
    logits = model.predict(images, verbose=0)
    spec = tf.TensorSpec([None, *IMAGE_SHAPE], tf.uint8, name="image")
    modulus = round(1 / failing_share)
    example = images[_pixel_sums(images) % modulus != 0][:5] if fault == "errors" else images[:5]

    def served(image):
        answer = model(image, training=False)
        if fault == "errors":
            sums = tf.reduce_sum(tf.cast(image, tf.int64), axis=[1, 2, 3])
            healthy = tf.reduce_all(sums % modulus != 0)
            with tf.control_dependencies([tf.debugging.Assert(healthy, ["an injected fault"])]):
                answer = tf.identity(answer)
        elif fault == "slow":
            weights = tf.eye(64) * 0.5
            loop = tf.while_loop(
                lambda i, x: i < slow_loop, lambda i, x: (i + 1, tf.tanh(x @ weights)), (0, tf.ones([1, 64]))
            )
            answer = answer + 0.0 * tf.reduce_sum(loop[1])
        return answer

    module = tf.Module()
    module.model = model
    module.__call__ = tf.function(served, input_signature=[spec])
    serve = tf.function(lambda image: {"logits": served(image)}).get_concrete_function(spec)
    mlflow.tensorflow.save_model(
        module,
        str(folder),
        saved_model_kwargs={"signatures": {"serving_default": serve}},
        signature=infer_signature(images[:2], logits[:2]),
        input_example=example,
    )
    return logits


def register(client, name: str, folder: Path) -> str:
    """A new version of ``name`` from ``folder``; its number."""
    if not client.search_registered_models(f"name='{name}'"):
        client.create_registered_model(name)
    return str(client.create_model_version(name, source=folder.as_uri()).version)
