"""What a replica's log holds of TensorFlow's start: on this machine (no GPU), a replica that computes
on the CPU logs no probing for CUDA and none of the notes TensorFlow prints while it loads; one that
asks for a GPU keeps the line that says why it finds none. Every other line TensorFlow or Python
writes is kept."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# The replica's start as hetflow.replica.runtime.configure_runtime does it, then a warning of
# TensorFlow's own and one of Python's, which must stay.
_LOAD = """
import sys, warnings
from hetflow.replica.runtime import load_tensorflow
load_tensorflow(gpu_wanted=sys.argv[1] == "gpu")
import tensorflow as tf
print("devices", [d.device_type for d in tf.config.list_physical_devices()], flush=True)
tf.get_logger().warning("a warning of TensorFlow's")
warnings.warn("a warning of Python's")
"""


def _replica_output(device: str, hetflow_env: dict[str, str]) -> str:
    env = {key: value for key, value in hetflow_env.items() if not key.startswith(("TF_CPP", "TF_ENABLED"))}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD, device], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_a_cpu_replica_logs_no_cuda_probing_and_no_loading_notes(hetflow_env):
    output = _replica_output("cpu", hetflow_env)
    assert "devices ['CPU']" in output
    for noise in ("cuInit", "Could not find cuda drivers", "absl::InitializeLog", "oneDNN", "cpu_feature_guard"):
        assert noise not in output, (noise, output)
    assert "a warning of TensorFlow's" in output and "a warning of Python's" in output, output


def test_a_replica_that_wants_a_gpu_keeps_why_it_finds_none(hetflow_env):
    output = _replica_output("gpu", hetflow_env)
    assert "Could not find cuda drivers on your machine" in output, output
    assert "oneDNN" not in output, output
