"""TFDS builder for ``synthetic_cifar``: GENERATED CIFAR-shaped images, for benchmarks only.

The data is not real images. Each of the 10 classes has a fixed random template (a random 8x8x3
pattern scaled up to 32x32x3, so it has spatial structure a convolution can pick up); every
example is its class's template shifted by up to 4 pixels (wrapping around) plus Gaussian pixel
noise, clipped to 0-255 uint8. A fixed numpy seed makes every build byte-identical. Shift and
noise keep it from being trivial (the convnet is at ~77% after one epoch), while a CNN still
reaches ~99% validation accuracy in two or three epochs. It exists so throughput benchmarks have
CIFAR-sized inputs (32x32x3, 10 classes, 10,000 training examples) without a network. Importing
this module registers the builder, so ``tfds.load("synthetic_cifar")`` works.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

from hetflow.data.features import labelled_images_info

SPLIT_SIZES = {"train": 10_000, "validation": 1_000, "test": 2_000}
NUM_CLASSES = 10
IMAGE_SHAPE = (32, 32, 3)
# Changing any of these changes the data and needs a new VERSION.
_SEED = 20261122
_TEMPLATE_CELLS = 8  # templates are 8x8 random cells, each 4x4 pixels
_TEMPLATE_RANGE = (64.0, 192.0)
_MAX_SHIFT = 4
_NOISE_STD = 96.0


def class_templates() -> np.ndarray:
    """The 10 class templates, float32 of shape (10, 32, 32, 3), values in _TEMPLATE_RANGE."""
    rng = np.random.default_rng([_SEED, 0])
    cells = rng.uniform(*_TEMPLATE_RANGE, size=(NUM_CLASSES, _TEMPLATE_CELLS, _TEMPLATE_CELLS, IMAGE_SHAPE[2]))
    scale = IMAGE_SHAPE[0] // _TEMPLATE_CELLS
    return cells.repeat(scale, axis=1).repeat(scale, axis=2).astype(np.float32)


class SyntheticCifar(tfds.core.GeneratorBasedBuilder):
    """Generated CIFAR-shaped data (32x32x3, 10 classes) for benchmarks; not real images."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: class templates plus noise, 10000/1000/2000 split, fixed seed."}
    # Same shard count as uci_digits, so file-level sharding behaves alike for both datasets.
    NUM_SHARDS = 4

    def _info(self) -> tfds.core.DatasetInfo:
        return labelled_images_info(self, __doc__, IMAGE_SHAPE, tfds.features.ClassLabel(num_classes=NUM_CLASSES))

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        templates = class_templates()
        # Each split draws from its own seeded stream, so the splits share no example.
        return {
            name: self._generate_examples(templates, size, split_seed=index + 1)
            for index, (name, size) in enumerate(SPLIT_SIZES.items())
        }

    def _generate_examples(self, templates: np.ndarray, size: int, split_seed: int):
        rng = np.random.default_rng([_SEED, split_seed])
        labels = rng.integers(0, NUM_CLASSES, size=size)
        for key, label in enumerate(labels):
            shift = rng.integers(-_MAX_SHIFT, _MAX_SHIFT + 1, size=2)
            shifted = np.roll(templates[label], tuple(shift), axis=(0, 1))
            noisy = shifted + rng.normal(0.0, _NOISE_STD, size=IMAGE_SHAPE)
            yield key, {"image": np.clip(np.round(noisy), 0, 255).astype(np.uint8), "label": int(label)}
