"""The spec of a run: RunSpec, in sections, and the one validation path behind its three views.

The Airflow trigger form (``Param``s), ``hetflow run --set key=value`` and JSON config files are
three views of this schema; ``parse_spec`` validates all of them. This package must stay cheap to
import: the DAG file imports it at parse time (no TensorFlow here), and the replica imports it
(Airflow only inside ``airflow_params``).
"""

from hetflow.spec.cluster import STRATEGIES, ClusterSpec, WorkerDevice
from hetflow.spec.data_roots import data_roots
from hetflow.spec.form import airflow_params
from hetflow.spec.messages import SpecError, parse_assignment
from hetflow.spec.run_spec import BACKEND_ONLY_KEYS, KEYS, SPEC_KEYS, RunSpec, flat_values, parse_spec
from hetflow.spec.sections import data_location_problems

__all__ = [
    "BACKEND_ONLY_KEYS",
    "KEYS",
    "SPEC_KEYS",
    "STRATEGIES",
    "ClusterSpec",
    "RunSpec",
    "SpecError",
    "WorkerDevice",
    "airflow_params",
    "data_location_problems",
    "data_roots",
    "flat_values",
    "parse_assignment",
    "parse_spec",
]
