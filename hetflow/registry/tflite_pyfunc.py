"""An MLflow pyfunc model that serves a TFLite file with the LiteRT interpreter.

Logged "from code" (this file is stored with the model), so loading it needs MLflow, numpy and
ai-edge-litert, not hetflow. Input: raw uint8 images (n, height, width, channels); output: logits.
"""

from __future__ import annotations

import numpy as np
from mlflow.pyfunc import PythonModel

import mlflow


class TFLiteClassifier(PythonModel):
    def load_context(self, context):
        from ai_edge_litert.interpreter import Interpreter

        self.interpreter = Interpreter(model_path=context.artifacts["tflite"])
        self.input_index = self.interpreter.get_input_details()[0]["index"]
        self.output_index = self.interpreter.get_output_details()[0]["index"]

    # The type hint tells MLflow the input is an array (its schema is the logged signature's).
    def predict(self, context, model_input: np.ndarray, params=None) -> np.ndarray:
        images = np.ascontiguousarray(model_input, dtype=np.uint8)
        self.interpreter.resize_tensor_input(self.input_index, images.shape)
        self.interpreter.allocate_tensors()
        self.interpreter.set_tensor(self.input_index, images)
        self.interpreter.invoke()
        return self.interpreter.get_tensor(self.output_index).copy()


mlflow.models.set_model(TFLiteClassifier())
