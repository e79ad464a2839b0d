"""`hetflow serve --render kubernetes` (hetflow/serving/kserve.py): each champion as a KServe
InferenceService, valid against KServe's own CRD (tests/schemas/README.md), its canary share and
replicas as set, its pods as locked down as the training pods, and what cannot be one refused in
one line. The registry is a real MLflow store holding a real SavedModel; no cluster runs here."""

from __future__ import annotations

import copy
import shutil

import pytest
import yaml
from crd_schema import crd_validator, errors
from kubernetes_pods import restricted_violations

from hetflow.cli.main import main
from hetflow.cluster.backends.kubernetes import manifests
from hetflow.registry import store
from hetflow.serving import kserve


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A version's files as MLflow's TensorFlow flavour lays them out: a real SavedModel (the export's
    uint8 ``image`` -> ``logits`` signature, one layer: nothing here runs it) in tf2model/."""
    import tensorflow as tf

    folder = tmp_path_factory.mktemp("saved") / "model"
    module = tf.Module()
    module.weights = tf.Variable(tf.ones([64, 10]))
    image = tf.TensorSpec([None, 8, 8, 1], tf.uint8, name="image")
    logits = tf.function(lambda image: {"logits": tf.reshape(tf.cast(image, tf.float32), [-1, 64]) @ module.weights})
    tf.saved_model.save(
        module, str(folder / "tf2model"), signatures={"serving_default": logits.get_concrete_function(image)}
    )
    (folder / "MLmodel").write_text("flavors:\n  tensorflow:\n    saved_model_dir: tf2model\n")
    return folder


@pytest.fixture(scope="module")
def isvc_validator():
    return crd_validator("serving.kserve.io_inferenceservices.yaml", "v1beta1")


@pytest.fixture(scope="module")
def stores(tmp_path_factory, saved_model):
    """Two stores (an MLflow store takes seconds to create: made once), their artifacts under one
    HETFLOW_HOME, as on the claim the pods mount: "good", the float model and its TFLite sibling as
    ``make run`` registers them, each its champion; "bad", a champion KServe cannot name and one
    whose files lie off the claim."""
    top = tmp_path_factory.mktemp("kserve")
    home = top / "home"
    tflite = top / "tflite"
    tflite.mkdir()
    (tflite / "MLmodel").write_text("flavors: {}\n")
    (tflite / "model.tflite").write_bytes(b"TFL3")
    models = {
        "good": {"hetflow-digits": (saved_model, home), "hetflow-digits-tflite": (tflite, home)},
        "bad": {"Digits_v2": (saved_model, home), "elsewhere": (saved_model, top / "off-claim")},
    }
    uris = {}
    for kind, registered in models.items():
        uris[kind] = f"sqlite:///{top / f'{kind}.db'}"
        client = store.client(uris[kind])
        for name, (files, under) in registered.items():
            target = under / "artifacts" / name
            shutil.copytree(files, target)
            client.create_registered_model(name)
            version = client.create_model_version(name, source=str(target))
            client.set_registered_model_alias(name, "champion", version.version)
    return home, uris, top


@pytest.fixture(params=["good"])
def registry(request, stores, monkeypatch):
    home, uris, top = stores
    monkeypatch.setenv("HETFLOW_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uris[request.param])
    return top


def _render(capsys, *arguments):
    capsys.readouterr()  # MLflow's notices of the new store
    code = main(["serve", "--render", "kubernetes", *arguments])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_inference_service_is_valid_against_kserves_crd_with_canary_and_replicas_as_set(
    registry, capsys, isvc_validator
):
    code, out, err = _render(capsys, "--model", "hetflow-digits", "--replicas", "3", "--canary-steps", "20,60,100")
    assert code == 0, err
    [isvc] = list(yaml.safe_load_all(out))
    assert errors(isvc_validator, isvc) == []
    assert (isvc["apiVersion"], isvc["kind"], isvc["metadata"]["name"]) == (
        "serving.kserve.io/v1beta1",
        "InferenceService",
        "hetflow-digits",
    )
    predictor = isvc["spec"]["predictor"]
    assert predictor["canaryTrafficPercent"] == 20  # the first canary step
    assert predictor["minReplicas"] == predictor["maxReplicas"] == 3
    assert "tensorflow" in predictor  # KServe's TF Serving runtime
    # The registry's SavedModel, on the claim holding HETFLOW_HOME, as TF Serving's version 1.
    [storage] = predictor["storageUris"]
    assert storage == {"uri": "pvc://hetflow-home/artifacts/hetflow-digits/tf2model", "mountPath": "/mnt/models/1"}
    assert isvc["metadata"]["labels"]["hetflow.dev/model-version"] == "1"
    # The defaults: one replica, 10% first.
    code, out, _ = _render(capsys, "--model", "hetflow-digits")
    assert code == 0
    [isvc] = list(yaml.safe_load_all(out))
    assert (isvc["spec"]["predictor"]["canaryTrafficPercent"], isvc["spec"]["predictor"]["minReplicas"]) == (10, 1)
    # The check bites: a field the CRD lacks, a value of the wrong type.
    isvc["spec"]["predictor"]["canaryTrafficPercentage"] = 10
    isvc["spec"]["predictor"]["minReplicas"] = "three"
    assert len(errors(isvc_validator, isvc)) == 2


def test_its_pods_are_locked_down_as_the_training_pods(registry, capsys):
    _, out, _ = _render(capsys, "--model", "hetflow-digits")
    predictor = next(yaml.safe_load_all(out))["spec"]["predictor"]
    assert predictor["securityContext"] == manifests.pod_security_context()
    assert predictor["securityContext"]["runAsUser"] == manifests.IMAGE_USER
    context = predictor["tensorflow"]["securityContext"]
    assert context == manifests.container_security_context()
    assert context["runAsNonRoot"] is True and context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
    assert predictor["automountServiceAccountToken"] is False
    # /tmp is the one writable place: a private emptyDir with a size limit.
    assert predictor["tensorflow"]["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert predictor["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "512Mi"}}]
    # The pod KServe makes of it (its container is kserve-container) meets the restricted standard.
    pod = {key: copy.deepcopy(value) for key, value in predictor.items() if key in ("securityContext", "volumes")}
    pod["containers"] = [{"name": "kserve-container", **copy.deepcopy(predictor["tensorflow"])}]
    assert restricted_violations(pod) == []
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    assert restricted_violations(pod) == ["container kserve-container: allowPrivilegeEscalation not false"]


NO_SAVED_MODEL = (
    "--model hetflow-digits-tflite: its champion, version 1, holds no SavedModel (tf2model/saved_model.pb) "
    "for TF Serving (a TFLite model is served by `hetflow serve` itself)"
)


def test_a_bad_model_name_or_target_is_refused_in_one_line(registry, capsys):
    code, out, err = _render(capsys, "--model", "hetflow-cats")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "hetflow serve: --model hetflow-cats: not a registered model with a champion; "
        "those with one: hetflow-digits, hetflow-digits-tflite"
    ]
    code, out, err = _render(capsys, "--model", "hetflow-digits-tflite")
    assert (code, out, err.splitlines()) == (2, "", [f"hetflow serve: {NO_SAVED_MODEL}"])
    capsys.readouterr()
    assert main(["serve", "--render", "helm"]) == 2
    assert capsys.readouterr().err == "hetflow serve: --render helm: one of kubernetes\n"


def test_every_champion_is_rendered_but_the_tflite_one_which_is_left_out_saying_so(registry, capsys):
    code, out, err = _render(capsys)
    assert code == 0
    assert [doc["metadata"]["name"] for doc in yaml.safe_load_all(out)] == ["hetflow-digits"]
    assert err.splitlines() == [f"hetflow serve: left out: {NO_SAVED_MODEL}"]


@pytest.mark.parametrize("registry", ["bad"], indirect=True)
def test_a_name_kserve_refuses_or_files_off_the_claim_are_refused_in_one_line(registry, capsys):
    code, out, err = _render(capsys, "--model", "Digits_v2")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "hetflow serve: --model 'Digits_v2': an InferenceService is named after its model, which must then be a "
        "DNS label (lower-case letters, digits and '-', starting with a letter, at most 63 characters)"
    ]
    code, out, err = _render(capsys, "--model", "elsewhere")
    assert (code, out) == (2, "")
    [line] = err.splitlines()
    files = registry / "off-claim" / "artifacts" / "elsewhere"
    assert line.startswith(f"hetflow serve: --model elsewhere: version 1's files are at {files}, which KServe cannot")


def test_object_store_locations_pass_and_others_off_the_claim_do_not(tmp_path):
    home = tmp_path / "home"
    assert kserve.kserve_uri("s3://models/1/tf2model", home, "c") == "s3://models/1/tf2model"
    assert kserve.kserve_uri(f"file://{home}/a/tf2model", home, "c") == "pvc://c/a/tf2model"
    assert kserve.kserve_uri("mlflow-artifacts:/1/models/m/artifacts/tf2model", home, "c") is None
    assert kserve.kserve_uri(str(tmp_path / "elsewhere"), home, "c") is None
