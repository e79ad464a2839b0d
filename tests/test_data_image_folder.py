"""Users' own images checked and prepared (hetflow/data/image_folder.py): the shape, classes and split
inferred, bad folders refused naming the file or folder, data outside the allowed roots and links
refused, and the pixels read back from the prepared dataset. The folders are written by the tests
(tests/digit_folders.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from digit_folders import write_digit_folder


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
    assert (again.reused, again.fingerprint, again.version) == (True, first.fingerprint, first.version)
    assert (first.input_shape, first.num_classes, first.splits["train"]) == ([28, 28, 1], 10, 70)
    assert first.class_names[3] == "digit_3" and first.source_path == str(root)

    write_digit_folder(root, per_class=2, first=10)  # two new images per class
    grown = prepare_dataset(f"folder:{root}", tmp_path / "data")
    assert not grown.reused and grown.fingerprint != first.fingerprint
    assert grown.version != first.version and grown.name == first.name == f"folder:{root}"
    assert grown.data_changed and sum(grown.splits.values()) == 120
    assert Path(first.prepared_dir).is_dir()  # the earlier version's data is kept for the runs that used it

    # An image changed in place, to other pixels of exactly its size in bytes: only its content differs.
    by_size: dict[int, list[Path]] = {}
    for path in sorted(root.glob("*/*.png")):
        by_size.setdefault(path.stat().st_size, []).append(path)
    edited_image, donor = next(
        paths for paths in by_size.values() if len(paths) > 1 and paths[0].parent != paths[1].parent
    )[:2]
    edited_image.write_bytes(donor.read_bytes())
    edited = prepare_dataset(f"folder:{root}", tmp_path / "data")
    assert edited.version != grown.version and edited.fingerprint != grown.fingerprint


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
    assert parse_spec({"dataset": f"folder:{inside}"}).data.dataset == f"folder:{inside}"
    for refused in (outside, tmp_path / "home" / "data" / "escape", tmp_path / "home" / "stack", Path("/etc")):
        with pytest.raises(SpecError) as caught:
            parse_spec({"dataset": f"folder:{refused}"})
        [problem] = caught.value.problems
        assert problem.startswith(f"dataset=folder:{refused} is invalid: expected a TFDS name or folder:PATH with ")
        assert f"under {tmp_path / 'home' / 'data'} " in problem and "HETFLOW_DATA_ROOTS" in problem
        assert "\n" not in problem
    monkeypatch.setenv("HETFLOW_DATA_ROOTS", str(tmp_path / "outside"))
    assert parse_spec({"dataset": f"folder:{outside}"}).data.dataset == f"folder:{outside}"


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


def test_the_folder_reached_through_a_link_swapped_in_above_it_after_the_scan_is_not_read(tmp_path):
    """scan resolved the folder, and that path is the one checked under the roots: the build reads
    from it, not from wherever a link swapped in along it since leads (a folder of the same layout)."""
    from hetflow.data.image_folder import LinkInFolder, load_pixels, scan

    root = write_digit_folder(tmp_path / "checked" / "digits", per_class=3)
    write_digit_folder(tmp_path / "outside" / "digits", per_class=3)
    inventory = scan(root)
    image = inventory.splits["train"][0][0]
    (tmp_path / "checked").rename(tmp_path / "moved")
    (tmp_path / "checked").symlink_to(tmp_path / "outside")
    with pytest.raises(LinkInFolder) as refused:
        load_pixels(inventory, image)
    assert str(refused.value) == (
        f"folder {root} is reached through the symbolic link {tmp_path / 'checked'} now, not as it was scanned: refused"
    )


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
