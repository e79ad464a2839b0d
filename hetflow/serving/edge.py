"""The edge bundle: what a phone polls for and fetches, the TFLite model's champion and its file.

The manifest is read from the version's tags, which register writes from the registered file itself
(``hetflow.registry.versions.edge_tags``: its sha256, size and TFLite metadata, and compress's LiteRT
latency): a device polls it cheaply, and ``fetch_edge_file`` checks the file it copies against it, so
a file that is not the one registered is never handed out. The endpoint serves these as
``GET /v1/edge/<model>/manifest`` and ``GET /v1/edge/<model>/model.tflite``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hetflow.artifacts.litert_latency import parse_latency_line
from hetflow.registry.versions import EDGE_TAGS, LATENCY_TAG
from mlflow import MlflowClient


class EdgeBundleError(ValueError):
    """A version with no edge bundle, or whose file is not the one its manifest names."""


def edge_manifest(client: MlflowClient, registered_model: str, alias: str = "champion") -> dict[str, Any]:
    """The manifest of ``registered_model``'s version at ``alias``: model, version, alias, file name,
    sha256, size in bytes, LiteRT latency (ms, by thread count) and the file's TFLite metadata."""
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(registered_model, alias)
    except MlflowException as error:
        raise EdgeBundleError(f"model {registered_model!r} has no version at alias {alias!r}") from error
    return {**_manifest(registered_model, version), "alias": alias}


def version_manifest(client: MlflowClient, registered_model: str, version: int | str) -> dict[str, Any]:
    """The manifest of one version of ``registered_model``, as ``edge_manifest`` gives it for an alias."""
    return _manifest(registered_model, client.get_model_version(registered_model, str(version)))


def fetch_edge_file(client: MlflowClient, registered_model: str, version: int | str, dest_dir: Path) -> Path:
    """Copy ``version``'s TFLite file into ``dest_dir`` (as ``<model>-v<version>.tflite``) once its
    sha256 is the manifest's; the copy is renamed into place whole, or not at all."""
    import mlflow

    manifest = version_manifest(client, registered_model, version)
    source = client.get_model_version(registered_model, str(version)).source
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".edge-", dir=dest_dir) as folder:
        copy = Path(
            mlflow.artifacts.download_artifacts(
                f"{source.rstrip('/')}/{manifest['path']}", dst_path=folder, tracking_uri=client.tracking_uri
            )
        )
        digest = hashlib.sha256(copy.read_bytes()).hexdigest()
        if digest != manifest["sha256"]:
            raise EdgeBundleError(
                f"{registered_model} version {version}: {manifest['path']} has sha256 {digest}, "
                f"its manifest says {manifest['sha256']}: not handed out"
            )
        target = dest_dir / f"{registered_model}-v{manifest['version']}.tflite"
        shutil.move(copy, target)
    return target


def _manifest(registered_model: str, version: Any) -> dict[str, Any]:
    tags = version.tags
    missing = [tag for tag in EDGE_TAGS.values() if tag not in tags]
    if missing:
        raise EdgeBundleError(
            f"{registered_model} version {version.version} has no edge bundle (tags {', '.join(missing)} missing): "
            "registered before hetflow wrote TFLite metadata, or not a TFLite model"
        )
    path = tags[EDGE_TAGS["file"]]
    return {
        "model": registered_model,
        "version": int(version.version),
        "file": Path(path).name,
        "path": path,  # in the version's files
        "sha256": tags[EDGE_TAGS["sha256"]],
        "size_bytes": int(tags[EDGE_TAGS["size_bytes"]]),
        "latency_ms": parse_latency_line(tags[LATENCY_TAG]) if LATENCY_TAG in tags else None,
        "metadata": json.loads(tags[EDGE_TAGS["metadata"]]),
    }
