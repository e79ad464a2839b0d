"""Users' own images: an image folder checked, prepared through TFDS, trained on, versioned.

The folders are written by the tests: the UCI digits scaled up to 28x28 PNGs, one folder per class.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import hetflow

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


def _scan_error(folder: Path, image_size: str = "") -> str:
    from hetflow.data.image_folder import scan

    with pytest.raises(ValueError) as raised:
        scan(folder, image_size)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_scan_infers_shape_classes_and_a_stratified_split(tmp_path):
    from hetflow.data.image_folder import scan

    inventory = scan(write_digit_folder(tmp_path / "digits"))
    assert inventory.shape == (28, 28, 1)
    assert inventory.classes == tuple(f"digit_{label}" for label in range(10))
    # 30 per class: 21 / 3 / 6 of each class (70/10/20), every class in every split
    assert {split: len(members) for split, members in inventory.splits.items()} == {
        "train": 210,
        "validation": 30,
        "test": 60,
    }
    for members in inventory.splits.values():
        counts = np.bincount([label for _, label in members], minlength=10)
        assert len(set(counts)) == 1
    everything = [relative for members in inventory.splits.values() for relative, _ in members]
    assert len(everything) == len(set(everything)) == 300
    assert all(relative.split("/")[0] == f"digit_{label}" for m in inventory.splits.values() for relative, label in m)


def test_colour_images_give_three_channels_and_image_size_resizes(tmp_path):
    from PIL import Image

    from hetflow.data.image_folder import load_pixels, scan

    for name, colour in (("red", (200, 10, 10)), ("blue", (10, 10, 200))):
        (tmp_path / "c" / name).mkdir(parents=True)
        for index in range(10):
            Image.new("RGB", (20 + index % 2 * 4, 16), colour).save(tmp_path / "c" / name / f"{index}.png")
    inventory = scan(tmp_path / "c", image_size="12x10")
    assert inventory.shape == (12, 10, 3)
    pixels = load_pixels(inventory, "red/1.png")  # a 24x16 image, resized
    assert pixels.shape == (12, 10, 3) and pixels.dtype == np.uint8
    assert tuple(pixels[5, 5]) == (200, 10, 10)


def test_a_train_and_test_layout_keeps_the_given_test_split(tmp_path):
    from hetflow.data.image_folder import scan

    write_digit_folder(tmp_path / "f" / "train", per_class=16)
    write_digit_folder(tmp_path / "f" / "test", per_class=4, first=16)
    inventory = scan(tmp_path / "f")
    assert len(inventory.splits["test"]) == 40
    assert all(relative.startswith("test/") for relative, _ in inventory.splits["test"])
    assert (len(inventory.splits["train"]), len(inventory.splits["validation"])) == (140, 20)


@pytest.mark.parametrize(
    "break_folder, expected",
    [
        (lambda root: root / "missing", "dataset=folder:{root}/missing: no such folder"),
        (
            lambda root: [__import__("shutil").rmtree(root / f"digit_{label}") for label in range(1, 10)] and root,
            "folder {root} has 1 class folder(s) (digit_0): expected 2 or more, one per class",
        ),
        (
            lambda root: [p.unlink() for p in (root / "digit_3").iterdir()] and root,
            "class folder {root}/digit_3 has no images: expected files ending .png",
        ),
        (
            lambda root: (root / "digit_4" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image") and root,
            "image {root}/digit_4/broken.png cannot be decoded",
        ),
    ],
    ids=["missing", "single_class", "empty_class", "corrupt_image"],
)
def test_bad_folders_are_refused_with_the_file_or_folder_named(tmp_path, break_folder, expected):
    root = write_digit_folder(tmp_path / "digits", per_class=3)
    folder = break_folder(root)
    assert expected.format(root=root) in _scan_error(folder)


def test_mixed_sizes_are_refused_unless_image_size_says_how_to_resize(tmp_path):
    root = write_digit_folder(tmp_path / "digits", per_class=3)
    write_digit_folder(tmp_path / "other", per_class=1, size=32)
    odd = next((tmp_path / "other" / "digit_7").iterdir())
    odd.rename(root / "digit_7" / odd.name)
    message = _scan_error(root)
    assert f"image {root}/digit_7/{odd.name} is 32x32" in message and "is 28x28" in message
    assert "set image_size=HEIGHTxWIDTH" in message
    from hetflow.data.image_folder import scan

    assert scan(root, image_size="28x28").shape == (28, 28, 1)


def test_new_images_make_a_new_prepared_version_beside_the_old(tmp_path):
    from hetflow.data.prepare import prepare_dataset

    root = write_digit_folder(tmp_path / "digits", per_class=10)
    first = prepare_dataset(f"folder:{root}", tmp_path / "data")
    again = prepare_dataset(f"folder:{root}", tmp_path / "data")
    assert (again["reused"], again["fingerprint"], again["version"]) == (True, first["fingerprint"], first["version"])
    assert (first["input_shape"], first["num_classes"], first["splits"]["train"]) == ([28, 28, 1], 10, 70)
    assert first["class_names"][3] == "digit_3" and first["source_path"] == str(root)

    write_digit_folder(root, per_class=2, first=10)  # two new images per class
    grown = prepare_dataset(f"folder:{root}", tmp_path / "data")
    assert not grown["reused"] and grown["fingerprint"] != first["fingerprint"]
    assert grown["version"] != first["version"] and grown["name"] == first["name"] == f"folder:{root}"
    assert grown["data_changed"] and sum(grown["splits"].values()) == 120
    assert Path(first["prepared_dir"]).is_dir()  # the earlier version's data is kept for the runs that used it

    # An image changed in place, to other pixels of exactly its size in bytes: only its content differs.
    by_size: dict[int, list[Path]] = {}
    for path in sorted(root.glob("*/*.png")):
        by_size.setdefault(path.stat().st_size, []).append(path)
    edited_image, donor = next(
        paths for paths in by_size.values() if len(paths) > 1 and paths[0].parent != paths[1].parent
    )[:2]
    edited_image.write_bytes(donor.read_bytes())
    edited = prepare_dataset(f"folder:{root}", tmp_path / "data")
    assert edited["version"] != grown["version"] and edited["fingerprint"] != grown["fingerprint"]


def test_the_validate_spec_task_refuses_a_bad_folder_before_it_makes_a_run_directory(tmp_path, monkeypatch):
    """What a trigger from the Airflow form meets: the DAG's first task fails with the one line."""
    from hetflow.spec import SpecError
    from hetflow.tasks.validate_spec import validate_spec

    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HETFLOW_DATA_ROOTS", str(tmp_path))  # a folder outside HETFLOW_HOME, as an operator allows
    root = write_digit_folder(tmp_path / "digits", per_class=3)
    (root / "digit_6" / "notes.png").write_text("not an image")
    with pytest.raises(SpecError) as refused:
        validate_spec({"dataset": f"folder:{root}"}, "bad-folder-run")
    assert refused.value.problems == [
        f"image {root}/digit_6/notes.png cannot be decoded (cannot identify image file '{root}/digit_6/notes.png')"
    ]
    assert not (tmp_path / "home" / "runs").exists()


def test_a_folder_outside_the_allowed_roots_is_refused_in_one_line(tmp_path, monkeypatch):
    """The pipeline reads every image of the folder into data the replicas see: like data_dir, the
    folder lies under HETFLOW_HOME/data or a root the operator lists; a link out of one is not."""
    from hetflow.spec import SpecError, parse_spec

    monkeypatch.setenv("HETFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HETFLOW_DATA_ROOTS", raising=False)
    inside = write_digit_folder(tmp_path / "home" / "data" / "digits", per_class=3)
    outside = write_digit_folder(tmp_path / "outside", per_class=3)
    (tmp_path / "home" / "data" / "escape").symlink_to(outside)
    assert parse_spec({"dataset": f"folder:{inside}"}).dataset == f"folder:{inside}"
    for refused in (outside, tmp_path / "home" / "data" / "escape", tmp_path / "home" / "stack", Path("/etc")):
        with pytest.raises(SpecError) as caught:
            parse_spec({"dataset": f"folder:{refused}"})
        [problem] = caught.value.problems
        assert problem.startswith(f"dataset=folder:{refused} is invalid: expected a TFDS name or folder:PATH with ")
        assert f"under {tmp_path / 'home' / 'data'} " in problem and "HETFLOW_DATA_ROOTS" in problem
        assert "\n" not in problem
    monkeypatch.setenv("HETFLOW_DATA_ROOTS", str(tmp_path / "outside"))
    assert parse_spec({"dataset": f"folder:{outside}"}).dataset == f"folder:{outside}"


@pytest.mark.parametrize("change", ["folder_link_swapped", "data_dir_link_swapped", "roots_narrowed"])
def test_prepare_data_checks_the_data_locations_again_before_reading(tmp_path, monkeypatch, change):
    """validate_spec confined data_dir and the folder to the allowed roots; what changed before
    prepare_data reads them (a link in the path now pointing out, the operator's roots narrowed) is
    refused there in one line naming the field, and nothing is read from or written to the outside."""
    from hetflow.paths import run_paths
    from hetflow.spec import SpecError
    from hetflow.tasks.prepare_data import prepare_data
    from hetflow.tasks.validate_spec import validate_spec

    home, outside = tmp_path / "home", tmp_path / "outside"
    monkeypatch.setenv("HETFLOW_HOME", str(home))
    monkeypatch.delenv("HETFLOW_DATA_ROOTS", raising=False)
    inside = write_digit_folder(home / "data" / "digits", per_class=3)
    write_digit_folder(outside / "digits", per_class=3)
    link = home / "data" / "linked"
    if change == "folder_link_swapped":
        link.symlink_to(inside)
        values, field = {"dataset": f"folder:{link}"}, f"dataset=folder:{link} is invalid: "
    elif change == "data_dir_link_swapped":
        (home / "data" / "tfds").mkdir()
        link.symlink_to(home / "data" / "tfds")
        values, field = {"data_dir": str(link)}, f"data_dir={link} is invalid: "
    else:
        monkeypatch.setenv("HETFLOW_DATA_ROOTS", str(outside))
        values, field = {"data_dir": str(outside / "tfds")}, f"data_dir={outside / 'tfds'} is invalid: "
    run_id = f"recheck-{change}"
    validate_spec(values, run_id)
    if change == "roots_narrowed":
        monkeypatch.delenv("HETFLOW_DATA_ROOTS")
    else:
        link.unlink()
        link.symlink_to(outside / "digits" if change == "folder_link_swapped" else outside)
    before = {folder: sorted(folder.rglob("*")) for folder in (outside, home / "data")}  # links not followed

    with pytest.raises(SpecError) as refused:
        prepare_data(run_id)
    message = str(refused.value)
    assert message.startswith(field) and "\n" not in message, message
    assert {folder: sorted(folder.rglob("*")) for folder in before} == before
    assert not run_paths(run_id).dataset.exists()


@pytest.mark.parametrize(
    "plant",
    [
        lambda root, outside: (root / "digit_1" / "planted.png").symlink_to(next((outside / "digit_1").iterdir())),
        lambda root, outside: (root / "digit_1" / "shadow.png").symlink_to("/etc/shadow"),
        lambda root, outside: (root / "digit_x").symlink_to(outside / "digit_2"),
    ],
    ids=["image_out_of_the_folder", "etc_shadow", "class_folder"],
)
def test_a_link_in_the_folder_is_refused_not_read(tmp_path, plant):
    root = write_digit_folder(tmp_path / "digits", per_class=3)
    outside = write_digit_folder(tmp_path / "outside", per_class=3)
    plant(root, outside)
    [link] = [path for path in root.rglob("*") if path.is_symlink()]
    assert _scan_error(root) == (
        f"{link} is a symbolic link: refused (images are read from the folder itself, never through a link; "
        "copy the file in)"
    )


def test_a_split_folder_that_is_a_link_is_refused(tmp_path):
    root = tmp_path / "f"
    write_digit_folder(root / "train", per_class=4)
    write_digit_folder(tmp_path / "elsewhere", per_class=2)
    (root / "test").symlink_to(tmp_path / "elsewhere")
    assert _scan_error(root).startswith(f"{root}/test is a symbolic link: refused")


def test_an_image_or_class_folder_swapped_for_a_link_after_the_scan_is_not_read(tmp_path):
    """The folder may change between the scan and the build: reading an image follows no link then
    either, for the image itself or for a folder on its way."""
    from hetflow.data.image_folder import LinkInFolder, load_pixels, scan

    root = write_digit_folder(tmp_path / "digits", per_class=3)
    outside = write_digit_folder(tmp_path / "outside", per_class=3)
    inventory = scan(root)
    image = next(relative for relative, _ in inventory.splits["train"] if relative.startswith("digit_0/"))
    (root / image).unlink()
    (root / image).symlink_to(next((outside / "digit_0").iterdir()))
    with pytest.raises(LinkInFolder, match=f"^{root / image} is a symbolic link: refused"):
        load_pixels(inventory, image)

    in_class_1 = next(relative for relative, _ in inventory.splits["train"] if relative.startswith("digit_1/"))
    (root / "digit_1").rename(tmp_path / "moved")
    (root / "digit_1").symlink_to(tmp_path / "moved")
    with pytest.raises(LinkInFolder, match=f"^{root / 'digit_1'} is a symbolic link: refused"):
        load_pixels(inventory, in_class_1)


def test_pixels_read_back_from_the_prepared_dataset_are_the_images(tmp_path):
    from PIL import Image

    from hetflow.data.pipeline import split_arrays
    from hetflow.data.prepare import prepare_dataset

    root = write_digit_folder(tmp_path / "digits", per_class=5)
    dataset = prepare_dataset(f"folder:{root}", tmp_path / "data")
    images, labels = split_arrays(dataset, "test")
    on_disk = {
        (int(path.parent.name.split("_")[1]), np.asarray(Image.open(path)).tobytes()) for path in root.glob("*/*.png")
    }
    assert images.shape == (10, 28, 28, 1)
    assert all((int(label), image[..., 0].tobytes()) in on_disk for image, label in zip(images, labels))


@pytest.mark.slow
class TestTrainingOnAnImageFolder:
    """The DAG end to end on a folder: registered, served and promoted; a repeat skipped; new images
    a new version; bad images refused with the champion untouched."""

    MODEL = "folder-digits"

    @pytest.fixture(scope="class")
    def folder(self, tmp_path_factory):
        return write_digit_folder(tmp_path_factory.mktemp("images") / "digits")

    @pytest.fixture(scope="class")
    def env(self, hetflow_env, tmp_path_factory):
        """The test's folders are under pytest's temporary folder: the operator's root for them."""
        return {**hetflow_env, "HETFLOW_DATA_ROOTS": str(tmp_path_factory.getbasetemp())}

    @pytest.fixture(scope="class")
    def client(self, hetflow_env):
        from mlflow import MlflowClient

        return MlflowClient(hetflow_env["MLFLOW_TRACKING_URI"])

    def run(self, env, folder, *sets):
        args = ["run", "--set", f"dataset=folder:{folder}", "--set", f"registered_model={self.MODEL}"]
        # Only the float SavedModel is exported, registered and served: the TFLite path is the same for any data.
        args += ["--set", "epochs=8", "--set", "prune=false", "--set", "quantize=none"]
        args += ["--set", 'export_formats=["saved_model"]']
        for assignment in sets:
            args += ["--set", assignment]
        done = hetflow(env, *args)
        lines = done.stdout.strip().splitlines()
        summary = json.loads(Path(lines[-1]).read_text()) if lines and lines[-1].endswith("summary.json") else None
        return done, summary

    @pytest.fixture(scope="class")
    def first(self, env, folder):
        return self.run(env, folder)

    def test_the_folder_trains_the_784_128_10_mlp_and_is_registered_served_and_promoted(self, first):
        from hetflow.models.architectures import build_model, read_weights
        from hetflow.paths import RunPaths

        done, summary = first
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert summary["status"] == "success" and summary["metrics"]["test_accuracy"] >= 0.8
        registry = summary["registry"]
        assert (registry["version"], registry["aliases"], registry["promoted"]) == (1, ["candidate", "champion"], True)
        assert registry["models"][0]["served"]["passed"]
        model = read_weights(build_model("mlp", [28, 28, 1], 10, seed=0), RunPaths(Path(summary["run_dir"])).model)
        kernels = [w.shape for w in model.get_weights() if w.ndim == 2]
        assert kernels == [(784, 128), (128, 10)]

    def test_mlflow_shows_the_dataset_the_curves_and_the_description(self, first, folder, client):
        import tensorflow as tf

        _, summary = first
        dataset = json.loads((Path(summary["run_dir"]) / "dataset.json").read_text())
        run = client.get_run(summary["mlflow_run_id"])
        [logged] = run.inputs.dataset_inputs
        assert logged.dataset.name == f"folder:{folder}@{dataset['version']}"
        assert logged.dataset.digest == dataset["fingerprint"][:36]
        assert json.loads(logged.dataset.source) == {"uri": str(folder)}
        image_spec = json.loads(logged.dataset.schema)["mlflow_colspec"][0]["tensor-spec"]
        assert image_spec == {"dtype": "uint8", "shape": [-1, 28, 28, 1]}
        assert [tag.value for tag in logged.tags if tag.key == "mlflow.data.context"] == ["training"]

        training = json.loads((Path(summary["run_dir"]) / "training.json").read_text())
        events = Path(client.download_artifacts(run.info.run_id, "tensorboard", str(Path(summary["run_dir"]) / "dl")))
        curves: dict[str, dict[int, float]] = {}
        for event_file in events.glob("validation/events.out.tfevents.*"):
            for event in tf.compat.v1.train.summary_iterator(str(event_file)):
                for value in event.summary.value:
                    curves.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
        assert curves["epoch_accuracy"] == pytest.approx(dict(enumerate(training["history"]["val_accuracy"])))

        version = client.get_model_version(self.MODEL, "1")
        assert f"fingerprint `{dataset['fingerprint']}`, from `{folder}`" in version.description
        assert "served check: passed" in version.description

    def test_the_same_data_and_spec_again_trains_and_registers_nothing(self, env, folder, first, client):
        done, summary = self.run(env, folder)
        assert done.returncode == 0, done.stderr[-3000:]
        assert summary["status"] == "skipped" and summary["failed_stage"] is None
        assert f"{self.MODEL} v1 was trained from this spec" in summary["skipped_because"]
        assert summary["registry"]["version"] == 1 and summary["artifacts"]["model"] is None
        assert not (Path(summary["run_dir"]) / "training.json").exists()
        assert [int(v.version) for v in client.search_model_versions(f"name='{self.MODEL}'")] == [1]

    def test_bad_data_is_refused_before_anything_starts_and_the_champion_stays(
        self, env, folder, first, client, tmp_path
    ):
        import shutil

        def copy(name):
            shutil.copytree(folder, tmp_path / name)
            return tmp_path / name

        truncated = copy("truncated")
        (truncated / "digit_5" / "cut.png").write_bytes(next((folder / "digit_5").glob("*.png")).read_bytes()[:60])
        single = copy("single")
        for label in range(1, 10):
            shutil.rmtree(single / f"digit_{label}")
        empty = copy("empty")
        for image in (empty / "digit_2").iterdir():
            image.unlink()
        mixed = copy("mixed")
        write_digit_folder(tmp_path / "big", per_class=1, size=32)
        odd = next((tmp_path / "big" / "digit_8").iterdir())
        odd.rename(mixed / "digit_8" / "odd.png")
        cases = {
            truncated: f"image {truncated}/digit_5/cut.png cannot be decoded",
            single: f"folder {single} has 1 class folder(s) (digit_0): expected 2 or more",
            empty: f"class folder {empty}/digit_2 has no images",
            mixed: f"image {mixed}/digit_8/odd.png is 32x32 but",
            tmp_path / "nowhere": f"dataset=folder:{tmp_path / 'nowhere'}: no such folder",
        }
        runs = Path(env["HETFLOW_HOME"]) / "runs"
        runs_before = sorted(runs.iterdir())
        for bad, message in cases.items():
            done, _ = self.run(env, bad)
            assert done.returncode == 2, done.stdout[-2000:]
            assert f"hetflow: invalid spec: {message}" in done.stderr
        assert sorted(runs.iterdir()) == runs_before
        assert int(client.get_model_version_by_alias(self.MODEL, "champion").version) == 1
        assert len(client.search_model_versions(f"name='{self.MODEL}'")) == 1

    def test_new_images_make_a_new_fingerprint_run_and_version(self, env, folder, first, client):
        write_digit_folder(folder, per_class=6, first=DIGITS_PER_CLASS)
        done, summary = self.run(env, folder)
        assert done.returncode == 0, done.stderr[-3000:]
        assert summary["status"] == "success"
        assert summary["dataset"]["fingerprint"] != first[1]["dataset"]["fingerprint"]
        assert sum(summary["dataset"]["splits"].values()) == 360
        assert summary["registry"]["version"] == 2 and summary["mlflow_run_id"] != first[1]["mlflow_run_id"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy_keys",
    [
        ["strategy=mirrored", "devices_per_worker=2"],
        ["strategy=multi_worker_mirrored", "workers=2"],
        ["strategy=parameter_server", "workers=2", "ps=1"],
        ["strategy=model_parallel", "devices_per_worker=2"],
        ["strategy=auto", "workers=2"],
    ],
    ids=lambda keys: keys[0].split("=")[1],
)
def test_every_strategy_trains_the_mlp_on_a_28x28_folder(hetflow_env, tmp_path_factory, strategy_keys):
    folder = tmp_path_factory.getbasetemp() / "strategy_digits"
    if not folder.exists():
        write_digit_folder(folder)
    args = ["train", "--set", f"dataset=folder:{folder}", "--set", "epochs=3", "--set", "steps_per_epoch=10"]
    for assignment in strategy_keys:
        args += ["--set", assignment]
    done = hetflow({**hetflow_env, "HETFLOW_DATA_ROOTS": str(folder.parent)}, *args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    training_path = Path(done.stdout.strip().splitlines()[-1])
    training = json.loads(training_path.read_text())
    requested = strategy_keys[0].split("=")[1]
    if requested == "auto":  # it trains with what it chose from the probes of both workers
        plan = json.loads((training_path.parent / "plan.json").read_text())
        assert [probe["worker"] for probe in plan["probes"]] == ["worker-0", "worker-1"]
        assert training["strategy"] == plan["decision"]["strategy"]
    else:
        assert training["strategy"] == requested
    assert training["history"]["val_accuracy"][-1] >= 0.4  # ten classes: chance is 0.1
