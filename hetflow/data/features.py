"""What every builder of hetflow's datasets declares alike: labelled uint8 images."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow_datasets as tfds


def labelled_images_info(
    builder: tfds.core.GeneratorBasedBuilder, description: str, shape: tuple[int, ...], label: Any, **more
) -> tfds.core.DatasetInfo:
    """``builder``'s DatasetInfo: an ``image`` of ``shape`` (uint8) and its ``label`` (a ClassLabel),
    supervised as (image, label), the order every input pipeline of hetflow reads."""
    return builder.dataset_info_from_configs(
        description=description,
        features=tfds.features.FeaturesDict(
            {"image": tfds.features.Image(shape=shape, dtype=np.uint8), "label": label}
        ),
        supervised_keys=("image", "label"),
        **more,
    )
