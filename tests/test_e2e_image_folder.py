"""Users' own images trained on end to end: a folder trained, registered, served and promoted, a
repeat skipped, new images a new version, bad images refused with the champion untouched, and every
strategy on a 28x28 folder. The folders are written by the tests (tests/digit_folders.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import hetflow
from digit_folders import DIGITS_PER_CLASS, write_digit_folder

from hetflow.paths import RunPaths
from hetflow.records import DatasetRecord


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
        dataset = DatasetRecord.read(RunPaths(Path(summary["run_dir"])))
        run = client.get_run(summary["mlflow_run_id"])
        [logged] = run.inputs.dataset_inputs
        assert logged.dataset.name == f"folder:{folder}@{dataset.version}"
        assert logged.dataset.digest == dataset.fingerprint[:36]
        assert json.loads(logged.dataset.source) == {"uri": str(folder)}
        image_spec = json.loads(logged.dataset.schema)["mlflow_colspec"][0]["tensor-spec"]
        assert image_spec == {"dtype": "uint8", "shape": [-1, 28, 28, 1]}
        assert [tag.value for tag in logged.tags if tag.key == "mlflow.data.context"] == ["training"]

        training = json.loads(RunPaths(Path(summary["run_dir"])).training.read_text())
        events = Path(client.download_artifacts(run.info.run_id, "tensorboard", str(Path(summary["run_dir"]) / "dl")))
        curves: dict[str, dict[int, float]] = {}
        for event_file in events.glob("validation/events.out.tfevents.*"):
            for event in tf.compat.v1.train.summary_iterator(str(event_file)):
                for value in event.summary.value:
                    curves.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
        assert curves["epoch_accuracy"] == pytest.approx(dict(enumerate(training["history"]["val_accuracy"])))

        version = client.get_model_version(self.MODEL, "1")
        assert f"fingerprint `{dataset.fingerprint}`, from `{folder}`" in version.description
        assert "served check: passed" in version.description

    def test_the_same_data_and_spec_again_trains_and_registers_nothing(self, env, folder, first, client):
        done, summary = self.run(env, folder)
        assert done.returncode == 0, done.stderr[-3000:]
        assert summary["status"] == "skipped" and summary["failed_stage"] is None
        assert f"{self.MODEL} v1 was trained from this spec" in summary["skipped_because"]
        assert summary["registry"]["version"] == 1 and summary["artifacts"]["model"] is None
        assert not RunPaths(Path(summary["run_dir"])).training.exists()
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

    # A second run through the DAG; new images making a new prepared version: test_data_image_folder.py.
    @pytest.mark.heavy
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
        # The strategies whose replicas read the data their own way: sync workers each take a shard,
        # parameter_server's workers each build their own pipeline, auto's probe it; mirrored and
        # model_parallel read it as one_device does above.
        ["strategy=multi_worker_mirrored", "workers=2"],
        # The other two read a TFDS dataset their own way in make test (test_replica_distributed.py,
        # test_replica_balance.py); on a folder: make test-all.
        pytest.param(["strategy=parameter_server", "workers=2", "ps=1"], marks=pytest.mark.heavy),
        pytest.param(["strategy=auto", "workers=2"], marks=pytest.mark.heavy),
    ],
    ids=lambda keys: keys[0].split("=")[1],
)
def test_strategies_reading_data_their_own_way_train_the_mlp_on_a_28x28_folder(
    hetflow_env, tmp_path_factory, strategy_keys
):
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
    if requested == "auto":  # it trains with what provisioning chose from the probes of both workers
        paths = RunPaths(training_path.parent.parent)
        plan = json.loads(paths.plan.read_text())
        assert [probe["worker"] for probe in plan["probes"]] == ["worker-0", "worker-1"]
        decided = json.loads(paths.spec.read_text())["cluster"]["strategy"]
        assert training["strategy"] == decided != "auto"
    else:
        assert training["strategy"] == requested
    assert training["history"]["val_accuracy"][-1] >= 0.4  # ten classes: chance is 0.1
