"""Datasets: the offline TFDS builder, preparation with a fingerprint, and the tf.data pipeline."""
