"""training.json's schema, and the one way the pipeline reads it.

The chief replica writes training.json (``hetflow.replica.record``); train returns it, evaluate
plots it, compress sizes its fine-tuning from it, register logs it into MLflow and summarize copies
it. A replica is untrusted, so every stage reads it with ``read_training``: a regular file, bounded,
every field the writer writes typed and in range (numbers finite, strings and lists bounded, lists
as long as the epochs that ran, workers as many as the spec has), no other key; and the fields the
spec decides (strategy, epochs, global batch, steps per epoch, target) equal to the spec's. Only
pydantic here: summarize and register import it without TensorFlow.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from hetflow.paths import NotRegularFile, read_replica_record
from hetflow.records import DatasetRecord
from hetflow.spec import RunSpec
from hetflow.spec.cluster import STRATEGIES

# parameter_server.STEPS_PER_CLOSURE: its epochs run in whole closures of this many steps.
PS_STEPS_PER_CLOSURE = 10
MAX_EPOCHS = 1000  # the spec's epochs bound
MAX_WORKERS = 1024
MAX_LAYERS = 256  # far above any architecture of hetflow.models, few enough to log
MAX_SECONDS = 1e7  # 115 days: above any run's time, below what fills a log or a plot axis
MAX_COUNT = 1 << 40  # examples, steps and bytes
TRAINED = tuple(strategy for strategy in STRATEGIES if strategy != "auto")  # auto has decided before training ends

Name = Annotated[str, StringConstraints(max_length=200)]
Digits = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,12}$")]
Rates = Annotated[list[Annotated[float, Field(ge=0, le=10 * 65_536)]], Field(max_length=MAX_EPOCHS)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Interval = Annotated[float, Field(ge=-MAX_SECONDS, le=MAX_SECONDS)]  # a difference of two clocks: may dip below 0
UnixTime = Annotated[float, Field(ge=0, le=1e11)]
Rate = Annotated[float, Field(ge=0, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Batch = Annotated[int, Field(ge=0, le=65_536)]
Curve = Annotated[list[Annotated[float, Field(ge=0, le=1e6)]], Field(max_length=MAX_EPOCHS)]
Accuracy = Annotated[list[Annotated[float, Field(ge=0, le=1)]], Field(max_length=MAX_EPOCHS)]


class Strict(BaseModel):
    """No key but those declared, no number that is not finite, no coercion (true is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class History(Strict):
    loss: Curve
    accuracy: Accuracy
    val_loss: Curve
    val_accuracy: Accuracy


class LearningRatePlan(Strict):
    scaling: Literal["none", "linear"]
    base: Annotated[float, Field(gt=0, le=10)]
    reference_batch: Annotated[int, Field(ge=1, le=65_536)] | None
    global_batch: Annotated[int, Field(ge=1, le=65_536)]
    peak: Annotated[float, Field(gt=0, le=10 * 65_536)]
    warmup_steps: Count


class Breakdown(Strict):
    start_up: Interval
    first_step: Interval
    steps: Interval
    validation: Interval
    between_epochs: Interval
    shutdown: Interval


class TrainingInput(Strict):
    """How the training split was read (``pipeline.training_input``): cached or streamed; under sync,
    the whole split as tensors in every worker or each worker its own files; under parameter_server
    each worker its own files, cached where its part fits the budget."""

    mode: Literal["cached", "streamed", "whole_split_tensors", "own_files", "own_files_cached"]
    split_bytes: Count
    cache_budget_bytes: Count
    shuffle_buffer: Annotated[int, Field(ge=1, le=1_000_000)]


class ValidationInput(Strict):
    """How validation read its split (``pipeline.validation_input``): the most examples one replica
    validates on (sync workers each take a share), cached after the first pass where they fit the budget."""

    mode: Literal["cached", "streamed"]
    examples: Count
    bytes: Count


class WorkerPart(Strict):
    steps: Count
    examples_per_second: Rate
    step_seconds: Seconds | None
    batch: Batch | None = None  # sync
    # sync and parameter_server: what it read of the training split's files per pass (pipeline.range_read)
    read_examples: Count | None = None
    read_files: Annotated[list[Name], Field(max_length=100_000)] | None = None
    read_file_bytes: Count | None = None
    staleness_mean: Annotated[float, Field(ge=0, le=MAX_COUNT)] | None = None  # parameter_server
    staleness_max: Count | None = None
    layers: Annotated[list[Name], Field(max_length=MAX_LAYERS)] | None = None  # model_parallel across workers
    variable_bytes: Count | None = None
    slot_bytes: Count | None = None


class Collectives(Strict):
    seconds_per_step: Seconds
    collectives_per_step: Annotated[int, Field(ge=0, le=10_000)]
    bytes_per_step: Count
    dtypes: Annotated[list[Annotated[str, StringConstraints(max_length=32)]], Field(max_length=16)]
    implementation: Literal["AUTO", "RING", "NCCL"]
    bytes_per_pack: Count
    timed_reductions: Annotated[int, Field(ge=0, le=10_000)]


class Staleness(Strict):
    mean: Annotated[float, Field(ge=0, le=MAX_COUNT)]
    max: Count
    histogram: Annotated[dict[Digits, Count], Field(max_length=10_000)]


class Shard(Strict):
    shape: Annotated[list[Count], Field(max_length=8)]
    device: Name


Shards = Annotated[list[Shard], Field(max_length=64)]


class Communication(Strict):
    seconds_per_step: Seconds
    bytes_to_worker: Count
    bytes_to_ps: Count
    variables: Annotated[int, Field(ge=0, le=10_000)]
    measured: Annotated[str, StringConstraints(max_length=300)]
    steps_per_closure: Annotated[int, Field(ge=1, le=10_000)]
    closure_seconds: Annotated[list[Seconds], Field(max_length=100)]


class Placement(Strict):
    layer: Name
    device: Name
    variables: Annotated[list[Name], Field(max_length=16)]


class TrainingRecord(Strict):
    """What ``hetflow.replica.record.training_record`` writes, with each strategy's own fields."""

    strategy: Literal[TRAINED]
    replicas_in_sync: Annotated[int, Field(ge=1, le=MAX_WORKERS * 16)]
    global_batch: Annotated[int, Field(ge=1, le=65_536)]
    per_replica_batch: Batch | Annotated[list[Batch], Field(min_length=1, max_length=MAX_WORKERS)]
    steps_per_epoch: Annotated[int, Field(ge=1, le=100_000 + PS_STEPS_PER_CLOSURE)]
    epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS)]
    history: History
    learning_rate_schedule: LearningRatePlan
    learning_rate_per_epoch: Rates
    train_seconds: Seconds
    epochs_done: Annotated[int, Field(ge=0, le=MAX_EPOCHS)]
    epoch_seconds: Annotated[list[Seconds], Field(max_length=MAX_EPOCHS)]
    validation_seconds: Annotated[list[Seconds], Field(max_length=MAX_EPOCHS)]
    time_to_first_step_seconds: Interval | None
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None
    seconds_to_target: Seconds | None
    target_reached_at: UnixTime | None
    examples_per_second: Rate
    launched_at: UnixTime
    weights_written_at: UnixTime
    whole_job_seconds: Seconds
    whole_job_examples_per_second: Rate
    whole_job_breakdown: Breakdown | None
    training_input: TrainingInput | None = None
    validation_input: ValidationInput | None = None
    per_worker: Annotated[
        dict[Annotated[str, StringConstraints(pattern=r"^worker-[0-9]{1,4}$")], WorkerPart],
        Field(max_length=MAX_WORKERS),
    ]
    # sync
    balanced: bool | None = None
    worker_batches: Annotated[list[Batch], Field(max_length=MAX_WORKERS)] | None = None
    collectives: Collectives | None = None
    # parameter_server
    staleness: Staleness | None = None
    sharded_variables: Annotated[dict[Name, Shards], Field(max_length=MAX_LAYERS)] | None = None
    communication: Communication | None = None
    # model_parallel
    layer_placement: Annotated[list[Placement], Field(max_length=MAX_LAYERS)] | None = None
    micro_batches: Annotated[int, Field(ge=1, le=64)] | None = None


def planned_steps(spec: RunSpec, dataset: DatasetRecord) -> int:
    """The steps an epoch of ``spec`` runs (``hetflow.models.schedule.steps_per_epoch``, in whole
    closures under parameter_server), from the pipeline's own records."""
    steps = spec.training.steps_per_epoch or max(1, dataset.splits["train"] // spec.training.batch_size)
    if spec.cluster.strategy == "parameter_server":
        return -(-steps // PS_STEPS_PER_CLOSURE) * PS_STEPS_PER_CLOSURE
    return steps


def _where(location: tuple) -> str:
    """A pydantic error's location as a field path: history.loss[2], per_worker.worker-0.steps."""
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def _as_spec_says(record: TrainingRecord, spec: RunSpec, dataset: DatasetRecord) -> list[tuple[str, str]]:
    """(field, what it must be) for each field that disagrees with the spec or with the epochs that ran."""
    training, strategy = spec.training, spec.cluster.strategy
    batch, target = record.global_batch, record.target_accuracy
    workers = max(1, spec.cluster.worker.replicas)
    steps, done = planned_steps(spec, dataset), record.epochs_done
    trained = done * record.steps_per_epoch
    per_epoch, each_epoch = f"{done} values, one per epoch done", f"{record.epochs} rates, one per epoch"
    checks = [
        ("strategy", f"the spec's {strategy}", record.strategy == strategy),
        ("epochs", f"the spec's {training.epochs}", record.epochs == training.epochs),
        ("global_batch", f"the spec's {training.batch_size}", batch == training.batch_size),
        ("steps_per_epoch", f"{steps}, the spec's", record.steps_per_epoch == steps),
        ("target_accuracy", f"the spec's {training.target_accuracy}", target == training.target_accuracy),
        ("epochs_done", f"at most epochs ({record.epochs})", done <= record.epochs),
        ("learning_rate_per_epoch", each_epoch, len(record.learning_rate_per_epoch) == record.epochs),
        ("epoch_seconds", per_epoch, len(record.epoch_seconds) == done),
        ("validation_seconds", per_epoch, len(record.validation_seconds) == done),
        *((f"history.{name}", per_epoch, len(values) == done) for name, values in record.history),
        ("per_worker", f"worker-0 to worker-{workers - 1}", all(int(name[7:]) < workers for name in record.per_worker)),
    ]
    for name, part in record.per_worker.items():
        checks.append((f"per_worker.{name}.steps", f"at most the {trained} steps trained", part.steps <= trained))
        checks.append((f"per_worker.{name}.batch", f"at most global_batch ({batch})", (part.batch or 0) <= batch))
    shares = record.per_replica_batch if isinstance(record.per_replica_batch, list) else [record.per_replica_batch]
    fits = len(shares) <= workers and max(shares) <= batch
    checks.append(("per_replica_batch", f"one per worker, each at most {batch}", fits))
    if record.training_input is not None:
        buffer = min(training.shuffle_buffer, dataset.splits["train"])
        checks.append(
            ("training_input.shuffle_buffer", f"{buffer}, the spec's", record.training_input.shuffle_buffer == buffer)
        )
    if record.worker_batches is not None:
        fits = len(record.worker_batches) == workers and sum(record.worker_batches) == batch
        checks.append(("worker_batches", f"{workers} shares summing to global_batch ({batch})", fits))
    if record.micro_batches is not None:
        checks.append(
            (
                "micro_batches",
                f"the spec's {spec.cluster.micro_batches}",
                record.micro_batches == spec.cluster.micro_batches,
            )
        )
    if record.staleness is not None:
        applied = sum(record.staleness.histogram.values())
        checks.append(("staleness.histogram", f"at most the {trained} updates applied", applied <= trained))
    return [(field, must) for field, must, holds in checks if not holds]


def read_training(path, spec: RunSpec, dataset: DatasetRecord) -> TrainingRecord:
    """training.json at ``path`` as the pipeline takes it: read as data (``read_replica_record``),
    checked against ``TrainingRecord`` and ``spec`` (the run's, and ``dataset``, the prepared data's:
    the pipeline's own records); else NotRegularFile, one line naming the file and the field.
    Returns the checked record."""
    value = read_replica_record(path)
    try:
        record = TrainingRecord.model_validate(value)
    except ValidationError as invalid:
        error = invalid.errors(include_url=False, include_input=False)[0]
        raise NotRegularFile(f"{path}: {_where(error['loc']) or 'the record'}: {error['msg']}: refused") from None
    wrong = _as_spec_says(record, spec, dataset)
    if wrong:
        field, must = wrong[0]
        raise NotRegularFile(f"{path}: {field} must be {must}: refused")
    return record
