"""Image folders written by the tests: the UCI digits scaled up to PNGs, one folder per class."""

from __future__ import annotations

from pathlib import Path

import numpy as np

DIGITS_PER_CLASS = 30


def write_digit_folder(root: Path, per_class: int = DIGITS_PER_CLASS, size: int = 28, first: int = 0) -> Path:
    """``per_class`` digits of each class as ``root/digit_<label>/<index>.png`` (grayscale,
    ``size`` x ``size``), starting at the class's ``first``-th digit."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for label in range(10):
        (root / f"digit_{label}").mkdir(parents=True, exist_ok=True)
        for index in np.flatnonzero(digits.target == label)[first : first + per_class]:
            pixels = np.round(digits.images[index] * 255 / 16).astype(np.uint8)
            image = Image.fromarray(pixels, "L").resize((size, size), Image.Resampling.BILINEAR)
            image.save(root / f"digit_{label}" / f"{index}.png")
    return root
