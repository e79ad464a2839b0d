"""The stages that read a split, each run alone in a fresh process on a generated dataset, for the
bounded-memory tests (test_data_streaming_memory.py): ``python streaming_stages.py RUN_DIR STAGE...``
runs each STAGE on the run ``make_run`` made and prints one JSON line: its peak resident memory
and each stage's seconds.

The generated images are flat grey squares, one per class (its shade, and a few noisy pixels): PNG
keeps them small on disk and quick to write, while decoded each is height x width x 3 bytes, so a
split's decoded size, what a stage holding it whole would hold, is chosen by its shape and count.
"""

from __future__ import annotations

import io
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

# A MLP on the generated images: the model is not what is measured, only what a stage holds of the split.
SPEC = {
    "model": "mlp",
    "seed": 1,
    "prune": False,
    "quantize": "int8",
    "max_accuracy_drop": 1.0,  # an untrained model: post-training int8 ships whatever it scores
    "export_formats": ["saved_model", "tflite"],
}
STAGES = ("evaluate", "compress", "export", "register")


def _png(image: np.ndarray, seed: int) -> bytes:
    """``image`` with a few noisy pixels, as PNG bytes."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    side = image.shape[0]
    image[rng.integers(side, size=8), rng.integers(side, size=8)] = rng.integers(256, size=(8, 3))
    return tf.io.encode_png(image).numpy()


def generated_dataset(data_dir: Path, splits: dict[str, int], side: int):
    """A prepared TFDS dataset of ``splits`` (examples per split) of side x side x 3 images, 10 classes."""
    import tensorflow_datasets as tfds
    from etils import epath

    from hetflow.data.features import labelled_images_info
    from hetflow.data.prepare import _fingerprint
    from hetflow.records import DatasetRecord

    class GeneratedFlatImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Flat grey squares with noisy pixels, labelled by shade (tests only)."""

        VERSION = tfds.core.Version("1.0.0")
        disable_shuffling = True  # examples in key order: TFDS's shuffle of the keys is time for nothing here
        # Where TFDS looks for the builder's metadata files (none): it would look in this module's
        # package, and tests/ is none.
        pkg_dir_path = epath.Path(data_dir)

        def _info(self):
            return labelled_images_info(self, self.__doc__, (side, side, 3), tfds.features.ClassLabel(num_classes=10))

        def _split_generators(self, dl_manager):
            return {name: self._generate_examples(count, seed) for seed, (name, count) in enumerate(splits.items())}

        def _generate_examples(self, count: int, seed: int):
            rng = np.random.default_rng(seed)
            for key, label in enumerate(rng.integers(10, size=count)):
                # Encoded once per class: TFDS encoding each example would be most of the cost.
                yield key, {"image": io.BytesIO(encoded[label]), "label": int(label)}

    encoded = [_png(np.full((side, side, 3), 20 * label + 5, np.uint8), label) for label in range(10)]
    data_dir.mkdir(parents=True, exist_ok=True)
    builder = GeneratedFlatImages(data_dir=str(data_dir))
    builder.download_and_prepare()
    info = builder.info
    return DatasetRecord(
        name="generated_flat_images",
        version=str(info.version),
        data_dir=str(data_dir),
        prepared_dir=str(builder.data_dir),
        source_path=str(builder.data_dir),
        reused=False,
        splits={split: info.splits[split].num_examples for split in info.splits},
        shards={split: info.splits[split].num_shards for split in info.splits},
        input_shape=[side, side, 3],
        num_classes=10,
        class_names=info.features["label"].names,
        fingerprint=_fingerprint(info, Path(builder.data_dir)),
        data_changed=False,
    )


def make_run(run_dir: Path, dataset, **spec_values) -> None:
    """A run directory as the stages find it after training: spec (``SPEC`` with ``spec_values``),
    dataset record, and the model's weights (as initialized: what is measured is the data, not the
    model)."""
    from hetflow.models.architectures import build_model
    from hetflow.paths import RunPaths
    from hetflow.replica.weights import save_model
    from hetflow.spec import RunSpec

    spec = RunSpec.from_values({**SPEC, **spec_values})
    paths = RunPaths(run_dir)
    paths.output.mkdir(parents=True)
    paths.spec.write_text(spec.model_dump_json())
    dataset.write(paths)
    save_model(build_model("mlp", dataset.input_shape, 10, 1), spec, dataset, paths.model)


def decoded_bytes(dataset, split: str) -> int:
    """What ``split`` takes decoded, as one array of its images."""
    return dataset.splits[split] * int(np.prod(dataset.input_shape))


def _register_reads(spec, paths, dataset) -> None:
    """What register reads of the data: the served checks' sample, and the champion's comparison on
    this test split (its loop, with the exported SavedModel where register would serve the champion)."""
    from hetflow.artifacts.predictors import saved_model_predictor
    from hetflow.artifacts.scoring import streamed_accuracy
    from hetflow.data.pipeline import split_batches, split_head
    from hetflow.serving.server import CHECK_EXAMPLES, REQUEST_BATCH

    images, _ = split_head(dataset, "test", CHECK_EXAMPLES)
    assert len(images) == min(CHECK_EXAMPLES, dataset.splits["test"])
    streamed_accuracy(saved_model_predictor(paths.saved_model), split_batches(dataset, "test", REQUEST_BATCH))


def run_stage(stage: str, run_dir: Path) -> None:
    from hetflow.models.architectures import trained_model
    from hetflow.paths import RunPaths
    from hetflow.pipeline.attempts import load_spec
    from hetflow.records import DatasetRecord
    from hetflow.replica.training_json import TrainingRecord

    paths = RunPaths(run_dir)
    spec, dataset = load_spec(paths), DatasetRecord.read(paths)
    if stage == "evaluate":
        from hetflow.tasks.evaluate import scores_on_test_split

        scores_on_test_split(trained_model(spec, dataset, paths.model), dataset).write(paths)
    elif stage == "compress":
        from hetflow.tasks.compress import compress_model

        compress_model(spec, paths, dataset, TrainingRecord.model_construct(epochs_done=1, steps_per_epoch=1))
    elif stage == "export":
        from hetflow.tasks.export import export_artifacts

        export_artifacts(spec, paths, dataset)
    elif stage == "register":
        _register_reads(spec, paths, dataset)
    else:
        raise ValueError(f"stage {stage!r}: expected one of {', '.join(STAGES)}")


def run_stages(run_dir: Path, stages: list[str]) -> dict:
    """``stages`` one after the other in this process, and its peak resident memory over them all."""
    seconds = {}
    for stage in stages:
        started = time.perf_counter()
        run_stage(stage, run_dir)
        seconds[stage] = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"stages": stages, "peak_rss_bytes": peak, "seconds": seconds}


if __name__ == "__main__":
    print(json.dumps(run_stages(Path(sys.argv[1]), sys.argv[2:])))
