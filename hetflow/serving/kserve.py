"""A registered model's champion as a KServe ``InferenceService`` (``serving.kserve.io/v1beta1``),
for clusters that run KServe: ``hetflow serve --render kubernetes`` prints it, to be applied with
``kubectl apply -f -``. Nothing here talks to an API server; the manifest is checked against
KServe's own CRD by the tests (tests/schemas/README.md).

It uses KServe's ``tensorflow`` predictor (the TF Serving runtime) on the version's SavedModel, the
one MLflow's TensorFlow flavour keeps at ``tf2model/`` among the version's files; ``minReplicas``
and ``maxReplicas`` are the endpoint's ``--replicas``; ``canaryTrafficPercent`` is the first of
``--canary-steps``: applied over a running InferenceService, KServe sends that share to the new
revision and the rest to the previous one (moving it on, or back to 0, is the operator's: KServe
does not judge a canary). Its pods are the training pods' (hetflow/cluster/backends/kubernetes/
manifests.py): numeric non-root ids, no privilege escalation or capability, a read-only root file
system with a private /tmp, no service-account token.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

from hetflow.cluster.backends.kubernetes.manifests import (
    TMP_VOLUME,
    container_security_context,
    pod_security_context,
    tmp_volume,
)

API_VERSION = "serving.kserve.io/v1beta1"
SAVED_MODEL = "tf2model"  # where MLflow's TensorFlow flavour keeps the SavedModel in a version's files
# TF Serving (the runtime's --model_base_path) loads numbered version folders under this path; the
# registry's SavedModel has none, so it is mounted as the version's own number there.
MODEL_BASE_PATH = "/mnt/models"
# What KServe's storage initializer fetches a folder from; http(s) fetches single files only.
FETCHABLE_SCHEMES = ("gs", "s3", "pvc", "hdfs", "webhdfs")
# metadata.name: KServe names the predictor's Service after it, a DNS-1035 label.
_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class RenderError(ValueError):
    """One line naming the option or the version and what is wrong."""


def inference_service(name: str, version: str, storage_uri: str, replicas: int, canary_percent: int) -> dict:
    """The InferenceService serving ``version`` of registered model ``name`` from ``storage_uri`` (the
    SavedModel's folder, as KServe fetches it). No namespace: ``kubectl apply -n`` chooses it."""
    if not _NAME.match(name):
        raise RenderError(
            f"--model {name!r}: an InferenceService is named after its model, which must then be a DNS label "
            "(lower-case letters, digits and '-', starting with a letter, at most 63 characters)"
        )
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "hetflow", "hetflow.dev/model-version": version},
            "annotations": {"hetflow.dev/model": name, "hetflow.dev/storage-uri": storage_uri},
        },
        "spec": {
            "predictor": {
                "minReplicas": replicas,
                "maxReplicas": replicas,
                "canaryTrafficPercent": canary_percent,
                "storageUris": [{"uri": storage_uri, "mountPath": f"{MODEL_BASE_PATH}/{version}"}],
                "tensorflow": {
                    "securityContext": container_security_context(),
                    "env": [{"name": "HOME", "value": "/tmp"}],
                    "volumeMounts": [{"name": TMP_VOLUME, "mountPath": "/tmp"}],
                },
                "securityContext": pod_security_context(),
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "volumes": [tmp_volume()],
            }
        },
    }


def kserve_uri(location: str, home: Path, volume_claim: str) -> str | None:
    """Where KServe fetches a registry location from: object stores as they are; a local path under
    HETFLOW_HOME on the claim that holds it (as the training pods mount it); None for anything else
    (a path off the claim, MLflow's ``mlflow-artifacts:`` proxy)."""
    parsed = urlparse(location)
    if parsed.scheme in FETCHABLE_SCHEMES:
        return location
    if parsed.scheme not in ("", "file"):
        return None
    path = Path(parsed.path).resolve()
    if not path.is_relative_to(home.resolve()):
        return None
    return f"pvc://{volume_claim}/{path.relative_to(home.resolve())}"


def render(
    client, tracking_uri: str, champions: dict[str, str], replicas: int, canary_percent: int, named: bool
) -> tuple[list[dict], list[str]]:
    """Each champion ``{model: version}`` as an InferenceService, and a line for each one left out:
    unless the models were ``named`` (``--model``), a champion without a SavedModel (the TFLite
    model's) is left out; otherwise RenderError names the first model that cannot be one (no
    SavedModel, files where KServe cannot fetch them, a name KServe refuses)."""
    from hetflow.paths import hetflow_home
    from hetflow.serving.replicas import registry_listing
    from hetflow.spec import RunSpec

    claim = RunSpec().cluster.kubernetes.volume_claim
    documents, left_out = [], []
    for name, version in sorted(champions.items()):
        location = client.get_model_version_download_uri(name, version).rstrip("/")
        if f"{SAVED_MODEL}/saved_model.pb" not in registry_listing(location, tracking_uri):
            why = (
                f"--model {name}: its champion, version {version}, holds no SavedModel ({SAVED_MODEL}/saved_model.pb) "
                "for TF Serving (a TFLite model is served by `hetflow serve` itself)"
            )
            if named:
                raise RenderError(why)
            left_out.append(why)
            continue
        uri = kserve_uri(f"{location}/{SAVED_MODEL}", hetflow_home(), claim)
        if uri is None:
            raise RenderError(
                f"--model {name}: version {version}'s files are at {location}, which KServe cannot fetch; "
                f"keep MLflow's artifacts in an object store ({', '.join(FETCHABLE_SCHEMES[:2])}) or under "
                f"HETFLOW_HOME ({hetflow_home()}), on the claim {claim!r}"
            )
        documents.append(inference_service(name, version, uri, replicas, canary_percent))
    return documents, left_out
