"""TFDS builder for the UCI optical recognition of handwritten digits, as shipped in scikit-learn.

1,797 real 8x8 grey images of digits 0-9 (values 0-16, rescaled here to 0-255 uint8 so every dataset
reaches the model as raw uint8 pixels). It needs no network, which makes it hetflow's offline
default. Importing this module registers the builder, so ``tfds.load("uci_digits")`` works.
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

from hetflow.data.features import labelled_images_info

# Fixed split of the 1,797 examples; changing it needs a new VERSION.
SPLIT_FRACTIONS = {"train": 0.7, "validation": 0.1, "test": 0.2}
_SPLIT_SEED = 20261122


class UciDigits(tfds.core.GeneratorBasedBuilder):
    """UCI optical digits (8x8) from scikit-learn."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: 70/10/20 train/validation/test split, fixed seed."}
    # The whole dataset is ~100 KB; several shards per split keep file-level sharding meaningful.
    NUM_SHARDS = 4

    def _info(self) -> tfds.core.DatasetInfo:
        return labelled_images_info(
            self,
            __doc__,
            (8, 8, 1),
            tfds.features.ClassLabel(num_classes=10),
            homepage="https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., np.newaxis]
        labels = digits.target.astype(np.int64)
        order = np.random.default_rng(_SPLIT_SEED).permutation(len(labels))
        splits, start = {}, 0
        for name, fraction in SPLIT_FRACTIONS.items():
            end = len(labels) if name == "test" else start + round(fraction * len(labels))
            splits[name] = self._generate_examples(images, labels, order[start:end])
            start = end
        return splits

    def _generate_examples(self, images: np.ndarray, labels: np.ndarray, indices: np.ndarray):
        for index in indices:
            yield int(index), {"image": images[index], "label": int(labels[index])}
