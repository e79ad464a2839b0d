"""bench/compression.py trains each seed with the job a DAG run of that model and seed trains:
the same spec, through the same training stages (compared as specs, not by training)."""

from __future__ import annotations

import sys

from conftest import REPO

from hetflow.cli.main import spec_values
from hetflow.spec import flat_values, parse_spec
from hetflow.spec.form import airflow_params

sys.path.insert(0, str(REPO / "bench"))  # the bench scripts import each other as top-level modules
import compression  # noqa: E402


def dag_spec(*assignments: str):
    """The spec a DAG run of `hetflow run --set ...` validates: its conf over the trigger form's
    Params (dags/hetflow_train.py's validate_spec: ``{**params, **dag_run.conf}``)."""
    conf = flat_values(spec_values(None, list(assignments)))
    return parse_spec({**{key: param.value for key, param in airflow_params().items()}, **conf})


def test_the_bench_trains_a_seed_with_the_spec_a_dag_run_of_it_validates():
    command = compression.train_command("cnn", 42)
    # hetflow train: validate_spec, prepare_data, provision_cluster and train, the DAG's own stages.
    assert command[0].endswith("/hetflow") and command[1] == "train"
    assignments = [arg.removeprefix("--set=") for arg in command[2:]]
    assert all(arg.startswith("--set=") for arg in command[2:])
    assert parse_spec(spec_values(None, assignments)) == dag_spec("model=cnn", "seed=42")
    # The issue's run also set target_sparsity=0.8: compress's key, which the training stages do not read;
    # the bench prunes every seed's one float model to each sparsity itself.
    issue = dag_spec("model=cnn", "seed=42", "target_sparsity=0.8")
    bench = parse_spec(spec_values(None, assignments))
    assert bench.model_copy(update={"compression": issue.compression}) == issue
