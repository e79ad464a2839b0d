"""Models. Each takes raw uint8 pixels (scaling lives inside the model, so an exported model needs
no preprocessing) and outputs logits, trained with a from-logits loss."""

from __future__ import annotations

import tensorflow as tf

MODELS = ("mlp", "cnn")


def build_model(kind: str, input_shape: list[int], num_classes: int, seed: int) -> tf.keras.Model:
    tf.keras.utils.set_random_seed(seed)
    layers = tf.keras.layers
    pixels = tf.keras.Input(shape=input_shape, dtype=tf.uint8, name="image")
    x = layers.Rescaling(1.0 / 255.0)(pixels)
    if kind == "mlp":
        x = layers.Flatten()(x)
        x = layers.Dense(128, activation="relu")(x)
    elif kind == "cnn":
        x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = layers.GlobalAveragePooling2D()(x)
        x = layers.Dense(64, activation="relu")(x)
    else:
        raise ValueError(f"model={kind!r} is invalid: expected one of {', '.join(MODELS)}")
    logits = layers.Dense(num_classes, name="logits")(x)
    return tf.keras.Model(pixels, logits, name=kind)


def compile_model(model: tf.keras.Model, optimizer: str, learning_rate: float) -> None:
    optimizers = {"sgd": tf.keras.optimizers.SGD, "adam": tf.keras.optimizers.Adam}
    model.compile(
        optimizer=optimizers[optimizer](learning_rate=learning_rate),
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[tf.keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )
