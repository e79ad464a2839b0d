"""Requests in TF Serving's and MLflow's JSON turned into the model's tensors and back: each input
checked against its signature, a bad one answered 400 naming the field and what was expected."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from loading import DEFAULT_SIGNATURE, Model, Signature, Spec
from request_error import bad_request


def _json_kind(array: np.ndarray) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers with a fraction"}.get(
        array.dtype.kind, "strings or objects"
    )


def as_tensor(value: Any, spec: Spec, field: str) -> np.ndarray:
    """``value`` (JSON lists) as ``spec``'s tensor, or a 400 naming the field and what was expected."""
    expected = f"the model's input {spec.name!r} of shape {spec.describe()}"
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):  # ragged lists, or integers beyond int64
        raise bad_request(f"{field}: not a rectangular array of numbers; expected {expected}")
    integral = spec.dtype.kind in "iu"
    if array.dtype.kind not in ("iu" if integral else "iuf"):
        raise bad_request(f"{field}: {_json_kind(array)} where {expected} takes {spec.dtype.name} values")
    if len(array.shape) != len(spec.shape) or any(e not in (-1, a) for e, a in zip(spec.shape, array.shape)):
        raise bad_request(f"{field}: shape {list(array.shape)}, expected {expected}")
    if integral and array.size:
        low, high = np.iinfo(spec.dtype).min, np.iinfo(spec.dtype).max
        if array.min() < low or array.max() > high:
            raise bad_request(
                f"{field}: values {array.min()}..{array.max()} out of {spec.dtype.name}'s range {low}..{high}"
            )
    return array.astype(spec.dtype, copy=False)


class Predictor:
    """Requests in TF Serving's and MLflow's JSON turned into the model's tensors and back."""

    def __init__(self, model: Model, max_instances: int):
        self.model = model
        self.max_instances = max_instances

    def signature(self, name: str | None) -> tuple[str, Signature]:
        key = DEFAULT_SIGNATURE if name in (None, "") else name
        if not isinstance(key, str) or key not in self.model.signatures:
            raise bad_request(
                f"signature_name: {key!r} is not one of this model's signatures: {', '.join(self.model.signatures)}"
            )
        return key, self.model.signatures[key]

    def _count(self, field: str, rows: Any) -> None:
        if not isinstance(rows, list):
            raise bad_request(f"{field}: expected a list, got {type(rows).__name__}")
        if not rows:
            raise bad_request(f"{field}: no values in the list")
        if len(rows) > self.max_instances:
            raise bad_request(
                f"{field}: {len(rows)} instances, over this server's limit of {self.max_instances} per request"
            )

    def _rows(self, instances: Any, signature: Signature) -> dict[str, np.ndarray]:
        self._count("instances", instances)
        specs = signature.inputs
        if isinstance(instances[0], dict) and "b64" not in instances[0]:
            if not all(isinstance(row, dict) and row.keys() == specs.keys() for row in instances):
                raise bad_request(f"instances: every object must have exactly the keys {', '.join(specs)}")
            return {n: as_tensor([row[n] for row in instances], s, f"instances[].{n}") for n, s in specs.items()}
        if len(specs) > 1:
            raise bad_request(f"instances: a plain list, but this model takes named inputs {', '.join(specs)}")
        [(name, spec)] = specs.items()
        return {name: as_tensor(instances, spec, "instances")}

    def _columns(self, inputs: Any, signature: Signature, field: str = "inputs") -> dict[str, np.ndarray]:
        specs = signature.inputs
        if not isinstance(inputs, dict):
            inputs = {next(iter(specs)): inputs} if len(specs) == 1 else None
        if inputs is None or inputs.keys() != specs.keys():
            raise bad_request(f"{field}: expected an object with exactly the keys {', '.join(specs)}, or a list")
        for name, value in inputs.items():
            self._count(f"{field}.{name}" if len(specs) > 1 else field, value)
        return {name: as_tensor(inputs[name], spec, field) for name, spec in specs.items()}

    def _run(self, key: str, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        return {name: value.tolist() for name, value in self.model.run(key, inputs).items()}

    def predict(self, request: dict[str, Any]) -> dict[str, Any]:
        """TF Serving's predict: ``instances`` answered with ``predictions``, ``inputs`` with ``outputs``."""
        key, signature = self.signature(request.get("signature_name"))
        if ("instances" in request) == ("inputs" in request):
            raise bad_request("expected exactly one of the keys 'instances' (rows) or 'inputs' (columns)")
        if "instances" in request:
            outputs = self._run(key, self._rows(request["instances"], signature))
            if len(outputs) == 1:
                return {"predictions": next(iter(outputs.values()))}
            count = len(next(iter(outputs.values())))
            return {"predictions": [{name: value[i] for name, value in outputs.items()} for i in range(count)]}
        outputs = self._run(key, self._columns(request["inputs"], signature))
        return {"outputs": next(iter(outputs.values())) if len(outputs) == 1 else outputs}

    def invocations(self, request: dict[str, Any]) -> dict[str, Any]:
        """MLflow's scoring protocol on the default signature; answers ``{"predictions": ...}``."""
        formats = [key for key in ("dataframe_split", "instances", "inputs") if key in request]
        unknown = set(request) - {"dataframe_split", "instances", "inputs", "params"}
        if len(formats) != 1 or unknown:
            raise bad_request("expected exactly one of the keys dataframe_split, instances or inputs (and params)")
        key, signature = self.signature(None)
        if formats == ["dataframe_split"]:
            inputs = self._dataframe(request["dataframe_split"], signature)
        elif formats == ["instances"]:
            inputs = self._rows(request["instances"], signature)
        else:
            inputs = self._columns(request["inputs"], signature)
        outputs = self._run(key, inputs)
        return {"predictions": next(iter(outputs.values())) if len(outputs) == 1 else outputs}

    def _dataframe(self, frame: Any, signature: Signature) -> dict[str, np.ndarray]:
        """A frame's rows, each the flattened tensor of one example, as MLflow reshapes them for a
        tensor signature."""
        if not isinstance(frame, dict) or "data" not in frame:
            raise bad_request("dataframe_split: expected an object with 'columns' and 'data'")
        if len(signature.inputs) != 1:
            raise bad_request(f"dataframe_split: this model takes named inputs {', '.join(signature.inputs)}")
        [(name, spec)] = signature.inputs.items()
        self._count("dataframe_split.data", frame["data"])
        if -1 in spec.shape[1:]:
            raise bad_request(f"dataframe_split: the input {name!r} of shape {spec.describe()} has no fixed row size")
        width = math.prod(size for size in spec.shape[1:])
        flat = as_tensor(frame["data"], Spec(name, spec.dtype, (-1, width)), "dataframe_split.data")
        return {name: flat.reshape((-1, *spec.shape[1:]))}

    def metadata(self, name: str, version: str) -> dict[str, Any]:
        """TF Serving's metadata answer: the signature defs, in its JSON form."""

        def tensor(spec: Spec) -> dict[str, Any]:
            dims = [{"size": str(size), "name": ""} for size in spec.shape]
            dtype = "DT_" + spec.dtype.name.upper().replace("FLOAT32", "FLOAT").replace("FLOAT64", "DOUBLE")
            return {"dtype": dtype, "tensor_shape": {"dim": dims, "unknown_rank": False}, "name": spec.name}

        definitions = {
            key: {
                "inputs": {n: tensor(s) for n, s in sig.inputs.items()},
                "outputs": {n: tensor(s) for n, s in sig.outputs.items()},
                "method_name": "tensorflow/serving/predict",
            }
            for key, sig in self.model.signatures.items()
        }
        return {
            "model_spec": {"name": name, "signature_name": "", "version": version},
            "metadata": {"signature_def": {"signature_def": definitions}},
        }
