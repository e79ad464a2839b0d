"""Users' own images: a folder with one sub-folder per class, built into a TFDS dataset.

Two layouts are read::

    FOLDER/<class>/<image>                          seeded, stratified 70/10/20 train/validation/test
    FOLDER/train/<class>/<image>, FOLDER/test/...   the test split as given; 1/8 of train validates

``scan`` checks the folder before anything starts (every image is decoded once; a symbolic link
where a class folder or an image is read is refused) and digests its content; the builder config
is named after that digest, so new images make a new prepared dataset (and fingerprint) beside the
old one, and unchanged images re-use what was prepared.

This is the one place images are shaped: each is converted to grayscale when every image of the
folder is grayscale, to RGB otherwise, and resized to ``image_size`` when the spec sets one. The
model receives these raw uint8 pixels and scales them itself (``hetflow.models.architectures``).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import os
import re
import stat
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
SPLIT_FRACTIONS = {"train": 0.7, "validation": 0.1, "test": 0.2}
VALIDATION_FROM_TRAIN = 1 / 8  # with a train/ and test/ layout
_SPLIT_SEED = 20261123
_GRAYSCALE_MODES = ("1", "L", "LA", "I", "I;16", "F")


@dataclasses.dataclass(frozen=True)
class FolderInventory:
    """What ``scan`` found: the classes (sorted names, label = position), each split's images
    (paths relative to the folder, with labels), the shape every image is given, and a digest of
    the folder's content (names and bytes)."""

    folder: Path
    classes: tuple[str, ...]
    splits: dict[str, tuple[tuple[str, int], ...]]
    shape: tuple[int, int, int]
    content_digest: str

    @property
    def config_name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "_", self.folder.name.lower()).strip("_") or "images"
        height, width, channels = self.shape
        return f"{slug[:40]}_{height}x{width}x{channels}_{self.content_digest[:12]}"


def parse_image_size(image_size: str | None) -> tuple[int, int] | None:
    """``"28x28"`` -> (28, 28); empty -> None (the images' own size)."""
    if not image_size:
        return None
    height, width = image_size.split("x")
    return int(height), int(width)


class LinkInFolder(ValueError):
    """A symbolic link where scan would read a class folder or an image."""


def _link_refused(path: Path) -> LinkInFolder:
    # Refused, not skipped: a skipped image would change the data (and its fingerprint) of a run that
    # succeeds without anyone noticing, and a link is what someone who can write the folder plants to
    # make the pipeline read a file of this machine (HETFLOW_HOME/stack, /etc/shadow) into training
    # data. Named like an image that does not decode, the user copies the file in or removes the link.
    return LinkInFolder(
        f"{path} is a symbolic link: refused (images are read from the folder itself, never through a link; "
        "copy the file in)"
    )


def _moved(root: Path, link: Path) -> LinkInFolder:
    return LinkInFolder(
        f"folder {root} is reached through the symbolic link {link} now, not as it was scanned: refused"
    )


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise _link_refused(path)


def _images_of(class_dir: Path) -> list[Path]:
    images = sorted(p for p in class_dir.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    for path in images:
        _refuse_link(path)
    return [path for path in images if path.is_file()]


def _class_dirs(root: Path, where: str) -> list[Path]:
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    for path in entries:
        if path.is_dir():
            _refuse_link(path)
    class_dirs = [path for path in entries if path.is_dir()]
    if len(class_dirs) < 2:
        found = ", ".join(p.name for p in class_dirs) or "none"
        raise ValueError(
            f"{where} {root} has {len(class_dirs)} class folder(s) ({found}): expected 2 or more, one per class"
        )
    for class_dir in class_dirs:
        if not _images_of(class_dir):
            suffixes = ", ".join(IMAGE_SUFFIXES)
            raise ValueError(f"class folder {class_dir} has no images: expected files ending {suffixes}")
    return class_dirs


def _stratified(
    labelled: list[tuple[str, int]], fractions: dict[str, float], where: str
) -> dict[str, list[tuple[str, int]]]:
    """Split each class by ``fractions`` (the last split takes the rest; every split gets at least
    one image of every class), in a seeded order."""
    rng = np.random.default_rng(_SPLIT_SEED)
    splits: dict[str, list[tuple[str, int]]] = {name: [] for name in fractions}
    for label in sorted({label for _, label in labelled}):
        members = [item for item in labelled if item[1] == label]
        if len(members) < len(fractions):
            class_dir = Path(members[0][0]).parent
            raise ValueError(
                f"class folder {where}/{class_dir} has {len(members)} image(s): expected at least "
                f"{len(fractions)}, one for each of the {', '.join(fractions)} splits"
            )
        order = rng.permutation(len(members))
        start = 0
        for position, (name, fraction) in enumerate(fractions.items()):
            later = len(fractions) - position - 1
            end = (
                len(members)
                if not later
                else start + min(max(1, round(fraction * len(members))), len(members) - start - later)
            )
            splits[name] += [members[i] for i in order[start:end]]
            start = end
    return splits


def scan(folder: str | Path, image_size: str | None = None) -> FolderInventory:
    """Check ``folder`` and list it; raise ValueError naming the folder or file at the first problem:
    a missing folder, fewer than two classes, an empty class, an image that does not decode, images of
    different sizes when ``image_size`` does not say what to resize them to, classes of train/ and
    test/ that differ."""
    from PIL import Image, UnidentifiedImageError

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"dataset=folder:{folder}: no such folder")
    root = root.resolve()
    split_roots = {"train": root / "train", "test": root / "test"}
    for split_root in split_roots.values():
        _refuse_link(split_root)
    given_splits = all(p.is_dir() for p in split_roots.values())
    if given_splits:
        per_split = {name: _class_dirs(path, f"{name} folder") for name, path in split_roots.items()}
        classes = tuple(p.name for p in per_split["train"])
        if tuple(p.name for p in per_split["test"]) != classes:
            raise ValueError(
                f"test folder {split_roots['test']} has classes {[p.name for p in per_split['test']]}, "
                f"train folder {split_roots['train']} has {list(classes)}: expected the same class folders"
            )
    else:
        per_split = {"all": _class_dirs(root, "folder")}
        classes = tuple(p.name for p in per_split["all"])

    digest = hashlib.sha256()
    sizes: dict[tuple[int, int], str] = {}
    grayscale = True
    labelled: dict[str, list[tuple[str, int]]] = {}
    for split, class_dirs in per_split.items():
        labelled[split] = []
        for label, class_dir in enumerate(class_dirs):
            for path in _images_of(class_dir):
                relative = str(path.relative_to(root))
                content = read_image(root, relative)
                digest.update(f"{relative}\0{len(content)}\0".encode())
                digest.update(content)
                try:
                    with Image.open(io.BytesIO(content)) as image:
                        image.load()
                        sizes.setdefault((image.height, image.width), relative)
                        grayscale &= image.mode in _GRAYSCALE_MODES
                except UnidentifiedImageError:
                    # PIL names the buffer it was given; the user needs the file.
                    raise ValueError(f"image {path} cannot be decoded (cannot identify image file '{path}')") from None
                except (OSError, SyntaxError) as error:
                    raise ValueError(f"image {path} cannot be decoded ({error})") from None
                labelled[split].append((relative, label))

    resize = parse_image_size(image_size)
    if resize is None and len(sizes) > 1:
        (size_a, file_a), (size_b, file_b) = list(sizes.items())[:2]
        raise ValueError(
            f"image {root / file_b} is {size_b[0]}x{size_b[1]} but {root / file_a} is {size_a[0]}x{size_a[1]}: "
            "expected every image the same size, or set image_size=HEIGHTxWIDTH to resize them all"
        )
    height, width = resize or next(iter(sizes))
    if resize is not None:
        digest.update(f"resized to {height}x{width}".encode())
    if given_splits:
        fractions = {"train": 1 - VALIDATION_FROM_TRAIN, "validation": VALIDATION_FROM_TRAIN}
        splits = {**_stratified(labelled["train"], fractions, str(root)), "test": labelled["test"]}
    else:
        splits = _stratified(labelled["all"], SPLIT_FRACTIONS, str(root))
    return FolderInventory(
        folder=root,
        classes=classes,
        splits={name: tuple(members) for name, members in splits.items()},
        shape=(height, width, 1 if grayscale else 3),
        content_digest=digest.hexdigest(),
    )


def _builder_class():
    """The TFDS builder, made on first use: TFDS is slow to import, and ``scan`` (run while the
    spec is validated) does not need it."""
    import tensorflow_datasets as tfds

    class ImageFolderDataset(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Images of a user's folder, one class per sub-folder."""

        VERSION = tfds.core.Version("1.0.0")
        RELEASE_NOTES = {"1.0.0": "Folder of class sub-folders; seeded stratified split."}

        def __init__(self, *, inventory: FolderInventory, **kwargs):
            self.inventory = inventory
            config = tfds.core.BuilderConfig(name=inventory.config_name, description=str(inventory.folder))
            super().__init__(config=config, **kwargs)

        def _info(self) -> tfds.core.DatasetInfo:
            from hetflow.data.features import labelled_images_info

            return labelled_images_info(
                self,
                f"Image folder {self.inventory.folder}",
                self.inventory.shape,
                tfds.features.ClassLabel(names=list(self.inventory.classes)),
                homepage=self.inventory.folder.as_uri(),
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(members) for split, members in self.inventory.splits.items()}

        def _generate_examples(self, members):
            for relative, label in members:
                yield relative, {"image": load_pixels(self.inventory, relative), "label": label}

    return ImageFolderDataset


def read_image(root: Path, relative: str) -> bytes:
    """The bytes of the regular file ``root/relative``, each name from ``/`` down opened without
    following a link: the folder may change between the scan and the build, and the build must not
    then be led out of it, nor away from ``root`` as the scan resolved it (a link swapped in above
    it). LinkInFolder (one line) otherwise."""
    *folders, name = Path(relative).parts
    reached = Path("/")
    directory = os.open(reached, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [*root.parts[1:], *folders]:
            reached /= part
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR) and reached.is_symlink():
                    inside = reached != root and reached.is_relative_to(root)
                    raise (_link_refused(reached) if inside else _moved(root, reached)) from None
                raise
            os.close(directory)
            directory = inner
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise _link_refused(root / relative) from None
            raise
    finally:
        os.close(directory)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LinkInFolder(f"image {root / relative} is not a regular file: refused")
        return handle.read()


def load_pixels(inventory: FolderInventory, relative: str) -> np.ndarray:
    """One image as the model receives it: uint8, ``inventory.shape``."""
    from PIL import Image

    height, width, channels = inventory.shape
    with Image.open(io.BytesIO(read_image(inventory.folder, relative))) as image:
        image = image.convert("L" if channels == 1 else "RGB")
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BILINEAR)
        pixels = np.asarray(image, dtype=np.uint8)
    return pixels[..., np.newaxis] if channels == 1 else pixels


def builder(inventory: FolderInventory, data_dir: Path):
    return _builder_class()(inventory=inventory, data_dir=str(data_dir))
