"""A version's model loaded straight from its MLflow folder: the TensorFlow flavor's SavedModel or
hetflow's TFLite pyfunc's file, as its signatures (named tensors' types and shapes) and one function
that runs a signature."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml

DEFAULT_SIGNATURE = "serving_default"


@dataclass(frozen=True)
class Spec:
    """One named tensor of a signature: its numpy type and shape (-1: any size)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{list(self.shape)} ({self.dtype.name})"


@dataclass(frozen=True)
class Signature:
    inputs: dict[str, Spec]
    outputs: dict[str, Spec]


@dataclass(frozen=True)
class Model:
    """A loaded model: its signatures, and ``run(signature_name, inputs) -> outputs`` by name."""

    flavor: str
    signatures: dict[str, Signature]
    run: Callable[[str, dict[str, np.ndarray]], dict[str, np.ndarray]]


def _tensorflow_model(path: Path, threads: int) -> Model:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    loaded = tf.saved_model.load(str(path))
    functions = dict(loaded.signatures)
    if not functions:
        raise ValueError(f"the SavedModel in {path} has no serving signatures")

    def spec(name: str, tensor: Any) -> Spec:
        shape = tuple(-1 if size is None else size for size in tensor.shape.as_list())
        return Spec(name, np.dtype(tensor.dtype.as_numpy_dtype), shape)

    signatures = {
        key: Signature(
            {name: spec(name, t) for name, t in sorted(function.structured_input_signature[1].items())},
            {name: spec(name, t) for name, t in sorted(function.structured_outputs.items())},
        )
        for key, function in functions.items()
    }

    def run(key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = functions[key](**{name: tf.constant(array) for name, array in inputs.items()})
        return {name: value.numpy() for name, value in outputs.items()}

    return Model("tensorflow", signatures, run)


def _tflite_model(path: Path, threads: int) -> Model:
    """LiteRT interpreters, ``threads`` of them (one is not safe in two threads at once), each used
    by one request at a time; the file's one input and output, named by its signature if it has one."""
    from ai_edge_litert.interpreter import Interpreter

    interpreters: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(threads):
        interpreters.put([Interpreter(model_path=str(path), num_threads=1), None])  # [interpreter, input shape]
    probe = Interpreter(model_path=str(path))
    [input_detail], [output_detail] = probe.get_input_details(), probe.get_output_details()
    signatures = probe.get_signature_list()
    key, names = next(iter(signatures.items())) if len(signatures) == 1 else (DEFAULT_SIGNATURE, {})
    input_name = (names.get("inputs") or ["input"])[0]
    output_name = (names.get("outputs") or ["output"])[0]

    def spec(name: str, detail: dict) -> Spec:
        return Spec(name, np.dtype(detail["dtype"]), tuple(int(size) for size in detail["shape_signature"]))

    def run(_key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        entry = interpreters.get()
        try:
            interpreter, shape = entry
            array = np.ascontiguousarray(inputs[input_name])
            if array.shape != shape:
                interpreter.resize_tensor_input(input_detail["index"], array.shape)
                interpreter.allocate_tensors()
                entry[1] = array.shape
            interpreter.set_tensor(input_detail["index"], array)
            interpreter.invoke()
            return {output_name: interpreter.get_tensor(output_detail["index"]).copy()}
        finally:
            interpreters.put(entry)

    signature = Signature({input_name: spec(input_name, input_detail)}, {output_name: spec(output_name, output_detail)})
    return Model("tflite", {key: signature}, run)


def _inside(root: Path, relative: str) -> Path:
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ValueError(f"MLmodel names {relative!r}, outside the model's folder")
    return path


def load_model(model_dir: Path, threads: int) -> Model:
    """The model of an MLflow model folder: the TensorFlow flavor's SavedModel, or hetflow's TFLite
    pyfunc's file (its ``tflite`` artifact)."""
    flavors = yaml.safe_load((model_dir / "MLmodel").read_text()).get("flavors") or {}
    if "tensorflow" in flavors:
        return _tensorflow_model(_inside(model_dir, flavors["tensorflow"]["saved_model_dir"]), threads)
    tflite = ((flavors.get("python_function") or {}).get("artifacts") or {}).get("tflite")
    if tflite:
        return _tflite_model(_inside(model_dir, tflite["path"]), threads)
    raise ValueError(f"{model_dir}/MLmodel has neither a tensorflow flavor nor a tflite artifact: {sorted(flavors)}")
