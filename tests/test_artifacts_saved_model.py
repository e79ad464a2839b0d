"""TF Serving's warm-up file in the exported SavedModel: PredictionLogs of real test images whose
inputs fit serving_default and which predict what the model predicts."""

from __future__ import annotations

import numpy as np


def test_the_warmup_requests_parse_fit_the_signature_and_predict_as_the_model(tmp_path):
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    from hetflow.artifacts.saved_model import save_serving_model
    from hetflow.data.pipeline import split_arrays
    from hetflow.data.prepare import prepare_dataset
    from hetflow.models.architectures import build_model

    dataset = prepare_dataset("uci_digits", tmp_path / "data")
    model = build_model("mlp", dataset.input_shape, dataset.num_classes, seed=1)
    save_serving_model(model, tmp_path / "saved_model", dataset)

    warmup = tmp_path / "saved_model" / "assets.extra" / "tf_serving_warmup_requests"
    logs = [prediction_log_pb2.PredictionLog.FromString(r.numpy()) for r in tf.data.TFRecordDataset(str(warmup))]
    requests = [log.predict_log.request for log in logs]
    assert [log.WhichOneof("log_type") for log in logs] == ["predict_log"] * 9
    assert {r.model_spec.signature_name for r in requests} == {"serving_default"}

    loaded = tf.saved_model.load(str(tmp_path / "saved_model"))
    signature = loaded.signatures["serving_default"]
    [(input_name, spec)] = signature.structured_input_signature[1].items()
    test_images, _ = split_arrays(dataset, "test")
    for index, request in enumerate(requests):
        assert list(request.inputs) == [input_name] == ["image"]
        tensor = request.inputs["image"]
        assert tf.dtypes.as_dtype(tensor.dtype) == spec.dtype == tf.uint8
        images = tf.make_ndarray(tensor)
        assert spec.shape.is_compatible_with(images.shape)
        # One test image each, in order, then the eight together: real examples, not noise.
        expected = test_images[index : index + 1] if index < 8 else test_images[:8]
        np.testing.assert_array_equal(images, expected)
        served = signature(image=tf.constant(images))["logits"].numpy()
        np.testing.assert_allclose(served, model.predict(images, verbose=0), rtol=1e-5, atol=1e-5)
