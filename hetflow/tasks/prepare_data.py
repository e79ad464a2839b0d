"""prepare_data: the dataset prepared (or re-used) and fingerprinted, and whether this training was
done before."""

from __future__ import annotations

import logging
from typing import Any

from hetflow.paths import run_paths
from hetflow.pipeline import timing
from hetflow.pipeline.attempts import attempt, load_spec, reported
from hetflow.records import TrainedBefore
from hetflow.spec import RunSpec, SpecError, data_location_problems, data_roots
from hetflow.spec.data_roots import confined

log = logging.getLogger("hetflow.stages")


@reported
def prepare_data(run_id: str, try_number: int | None = None) -> dict[str, Any]:
    """Prepare the dataset (or re-use it) and say whether this training was done before: with
    skip_unchanged, a version trained by another run from the same spec on the same data makes the
    rest of the run skip (``trained_before``, and why in ``skip_reason``)."""
    from hetflow.data.prepare import dataset_dir, prepare_dataset
    from hetflow.registry.training_key import skip_reason, training_key

    paths = run_paths(run_id)
    with attempt(paths, "prepare_data", run_id, try_number) as receipt:
        spec = load_spec(paths)
        # validate_spec confined them, maybe long ago: a link swapped in since, or roots the operator
        # has narrowed since, must stop the reading here.
        problems = data_location_problems(spec.data)
        if problems:
            raise SpecError(problems)
        prepared = prepare_dataset(_checked_dataset(spec), dataset_dir(spec), spec.data.image_size)
        key = training_key(spec, prepared.fingerprint)
        before = _trained_before(spec, key, run_id)
        record = prepared.model_copy(update={"training_key": key, "trained_before": before})
        if before:  # what summarize and the DAG's skip say
            record = record.model_copy(update={"skip_reason": skip_reason(record)})
        record.write(paths)
    log.info(
        "dataset %s %s %s (fingerprint %s)",
        record.name,
        record.version,
        "re-used" if record.reused else "prepared",
        record.fingerprint[:12],
    )
    if record.trained_before:
        log.info("unchanged: %s", record.skip_reason)
    return {**record.as_json(), "attempt": receipt}


def _checked_dataset(spec: RunSpec) -> str:
    """The dataset to read: a folder resolved once and checked under the roots as resolved, so that
    what is read is what was checked (the scan follows no link along it)."""
    if not spec.data.folder:
        return spec.data.dataset
    try:
        return f"folder:{confined(spec.data.folder, 'dataset', data_roots())}"
    except ValueError as refused:
        raise SpecError([str(refused)]) from None


def _trained_before(spec: RunSpec, key: str, run_id: str) -> TrainedBefore | None:
    if not spec.data.skip_unchanged:
        return None
    from hetflow.registry import store
    from hetflow.registry.training_key import trained_before

    try:
        with timing.part("mlflow_io"):
            return trained_before(store.client(), spec.registry.model_name, key, run_id)
    except Exception as error:  # noqa: BLE001  (an unreachable server, two runs creating one SQLite store, ...)
        # Training is never skipped on a guess; register will say if MLflow is still away.
        log.warning("could not ask MLflow whether this training was done before (%s): training", error)
        return None
