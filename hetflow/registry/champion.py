"""The champion gate: a registered version gets ``candidate``, and takes ``champion`` when its
served check passed and it beats the champion's accuracy on this run's test split by
``min_improvement``.

``champion`` moves under one lock per registered model, so that concurrent runs compare against
the champion as it is when they set the alias; the decision is recorded on the version, so a
retried task applies it once. A champion that cannot be scored (it cannot be served) leaves the gate
undecided: the candidate is not promoted, the reason is recorded, and a retry of the task decides again."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mlflow.exceptions import MlflowException

from hetflow.paths import hetflow_home
from hetflow.pipeline import timing
from hetflow.records import DatasetRecord
from hetflow.registry import store
from hetflow.registry.registry_lock import RegistryLock, local_lock_identity
from hetflow.serving import server as serving
from hetflow.spec import RunSpec
from mlflow import MlflowClient

log = logging.getLogger("hetflow.registry")

CANDIDATE, CHAMPION = "candidate", "champion"
# The start of a gate that compared nothing: a serving failure of the champion is no win for the candidate.
UNDECIDED = "undecided"


@contextmanager
def promotion_lock(name: str, client: MlflowClient | None = None, purpose: str = "promotion"):
    """Hold the one promotion of registered model ``name`` in its registry; yields the registry's
    lock, whose ``confirm()`` says it is still held.

    Two locks, one inside the other. First an exclusive lock on a file under $HETFLOW_HOME, which
    serializes the processes of one deployment cheaply and is released by the kernel when its holder
    dies; its file is named after the registry's identity (the model's creation time as the registry
    records it), not the tracking URI's spelling. Then the lock in the registry itself
    (``registry_lock``), which also excludes other hosts and other homes; one left by a holder that
    died holding this same file's flock is taken over at once, others once their heartbeat stops."""
    client = client or store.client()
    created = client.get_registered_model(name).creation_timestamp
    key = hashlib.sha256(f"{name}\n{created}".encode()).hexdigest()[:16]
    path = hetflow_home() / "locks" / f"promote-{key}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # closing the file releases it
        held = RegistryLock(client, name, purpose, local_lock_identity(handle))
        held.acquire()
        try:
            yield held
        finally:
            held.release()


def version_by_alias(client: MlflowClient, name: str, alias: str):
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def champion_accuracy(champion, dataset: DatasetRecord, log_dir: Path, registry: str) -> float:
    """The champion's test accuracy on *this* run's test split.

    Its recorded accuracy counts when it was measured on the same prepared data (same dataset
    fingerprint); otherwise the champion is served and scored on this test split over HTTP, streamed
    in batches: it is never loaded in this process, where a registered model's code would run. Raises
    ``serving.ServingError`` when it cannot be served.

    :param registry: the tracking URI of the registry the champion is in.
    """
    if champion.tags.get("dataset.fingerprint") == dataset.fingerprint:
        return float(champion.tags["test_accuracy"])
    from hetflow.artifacts.scoring import streamed_accuracy
    from hetflow.data.pipeline import split_batches

    uri = f"models:/{champion.name}/{champion.version}"
    with (
        timing.part("serving"),
        serving.ModelServer(uri, registry, log_dir / f"{champion.name}-v{champion.version}-champion.log") as server,
    ):
        # Batch by batch, each one request (serving.REQUEST_BATCH): the split is never held whole here.
        return streamed_accuracy(server.predict, split_batches(dataset, "test", serving.REQUEST_BATCH))


def gate(spec: RunSpec, candidate_accuracy: float, champion, champion_score: float | None) -> dict[str, Any]:
    """Whether the candidate takes ``champion``: when there is none, or it beats it by min_improvement."""
    if champion is None:
        return {"promote": True, "reason": "no champion yet"}
    margin = candidate_accuracy - champion_score
    promote = margin >= spec.registry.min_improvement
    verb = "beats" if promote else "does not beat"
    return {
        "promote": promote,
        "reason": (
            f"test accuracy {candidate_accuracy:.4f} {verb} champion v{champion.version} "
            f"({champion_score:.4f}) by min_improvement {spec.registry.min_improvement} (margin {margin:+.4f})"
        ),
    }


def start_served_check(
    pool: ThreadPoolExecutor,
    client: MlflowClient,
    version,
    predict: Callable[[np.ndarray], np.ndarray],
    images: np.ndarray,
    log_dir: Path,
) -> Future | None:
    """Start the served check of a version in ``pool``, comparing with ``predict``'s logits; None when a
    previous try of the task decided the version's gate (it is not served again)."""
    if _decided(client, version) is not None:
        return None
    batch = images[: serving.CHECK_EXAMPLES]
    log_path = log_dir / f"{version.name}-v{version.version}.log"
    uri = f"models:/{version.name}/{version.version}"
    return pool.submit(serving.served_check, uri, client.tracking_uri, batch, predict(batch), log_path)


def _decided(client: MlflowClient, version) -> str | None:
    """The gate's decision on ``version`` when a previous try of the task applied it, else None (also
    when that try left it undecided: the champion may be servable now)."""
    recorded = client.get_model_version(version.name, version.version).tags
    champion = version_by_alias(client, version.name, CHAMPION)
    if "gate" not in recorded and champion is not None and champion.version == version.version:
        return "already champion (task retried)"
    gate_recorded = recorded.get("gate")
    return None if gate_recorded is not None and gate_recorded.startswith(UNDECIDED) else gate_recorded


def task_difference(champion, dataset: DatasetRecord) -> str | None:
    """How the task the champion was trained for differs from this run's (another dataset, input
    shape or number of classes), one phrase; None for the same task, whatever its data's version."""
    ours = {"dataset": dataset.name, "input shape": input_shape_tag(dataset), "classes": str(dataset.num_classes)}
    theirs = {"dataset": "dataset.name", "input shape": "dataset.input_shape", "classes": "dataset.classes"}
    differ = [
        f"{what} {champion.tags[tag]} (this run: {ours[what]})"
        for what, tag in theirs.items()
        if tag in champion.tags and champion.tags[tag] != ours[what]  # versions of older hetflows lack some
    ]
    return ", ".join(differ) or None


def input_shape_tag(dataset: DatasetRecord) -> str:
    return "x".join(map(str, dataset.input_shape))


def _compare(client: MlflowClient, version, accuracy: float, dataset: DatasetRecord, log_dir: Path):
    """Under the lock: the champion, its score on this run's test split, what the candidate was
    compared with (one line), and the decision where no score could be had (None: the gate decides)."""
    champion = version_by_alias(client, version.name, CHAMPION)
    if champion is None:
        return None, None, "no champion yet", None
    other_task = task_difference(champion, dataset)
    if other_task is not None:  # a decision, not a failure to decide: a retry would find the same
        why = (
            f"not compared: champion v{champion.version} was trained for another task, {other_task}; version "
            f"{version.version} stays candidate (give this data a registered_model of its own)"
        )
        return champion, None, why, {"promote": False, "reason": why}
    try:
        score = champion_accuracy(champion, dataset, log_dir, client.tracking_uri)
    except (serving.ServingError, OSError) as error:
        unscored = " ".join(  # one line: the error may end with the server's log
            f"champion v{champion.version} could not be served to score it on this test split, "
            f"so version {version.version} stays candidate: {error}".split()
        )
        # Nothing was compared: a failure to decide, not a win, and a retry decides again.
        return champion, None, unscored, {"promote": False, "reason": f"{UNDECIDED}: {unscored}"}
    return champion, score, f"champion v{champion.version} {score:.4f} (margin {accuracy - score:+.4f})", None


def _decide(spec: RunSpec, client: MlflowClient, version, accuracy: float, dataset: DatasetRecord, served, log_dir):
    """Under the promotion lock: the gate's decision, and what the candidate was compared with."""
    champion, score, versus, unscored_decision = _compare(client, version, accuracy, dataset, log_dir)
    if not served["passed"]:
        return {"promote": False, "reason": f"served check failed: {served['reason']}"}, versus
    return unscored_decision or gate(spec, accuracy, champion, score), versus


def promote(
    client: MlflowClient,
    spec: RunSpec,
    version,
    accuracy: float,
    dataset: DatasetRecord,
    tags: dict[str, str],
    check: Future | None,
    report: str,
    table: str,
    log_dir: Path,
) -> dict[str, Any]:
    """Tag the version and give it ``candidate``; give it ``champion`` when it passes the served
    check (``check``, running: None when ``start_served_check`` found the gate already applied) and the
    accuracy gate; describe it."""
    name = version.name
    for key, value in {**tags, "test_accuracy": repr(accuracy)}.items():
        client.set_model_version_tag(name, version.version, key, value)
    client.set_registered_model_alias(name, CANDIDATE, version.version)
    # A retried task finds the gate already applied to this version: its decision stands.
    decided, served_record = _decided(client, version), log_dir / f"{name}-v{version.version}.served.json"
    if decided is not None:
        champion = version_by_alias(client, name, CHAMPION)
        decision = {"promote": champion is not None and champion.version == version.version, "reason": decided}
        served = json.loads(served_record.read_text()) if served_record.exists() else None
    else:
        with timing.part("serving"):
            served = check.result()  # the candidate's own check, independent of the champion: outside the lock
        with promotion_lock(name, client, f"deciding whether version {version.version} becomes champion") as held:
            # Read again under the lock: another run may have moved `champion` since the read above,
            # and none can move it between this read and our set.
            decision, versus = _decide(spec, client, version, accuracy, dataset, served, log_dir)
            if decision["promote"]:
                held.confirm()  # a holder cut off from the registry long enough was taken over
                client.set_registered_model_alias(name, CHAMPION, version.version)
            # The decision is recorded under the lock too: a retry of this task must find it, and the
            # check's figures (in the run's folder: the registry shows a reviewer the sentence).
            served_record.parent.mkdir(parents=True, exist_ok=True)
            served_record.write_text(json.dumps(served))
            client.set_model_version_tag(name, version.version, "served", serving.describe(served)[:5000])
            client.set_model_version_tag(name, version.version, "gate", decision["reason"][:5000])
        client.update_model_version(
            name, version.version, description=_description(report, accuracy, versus, served, decision, table)
        )
    log.info("%s gate: %s -> %s", name, decision["reason"], "champion" if decision["promote"] else "stays candidate")
    return {
        "model_name": name,
        "version": int(version.version),
        "model_uri": f"models:/{name}/{version.version}",
        "aliases": sorted(client.get_model_version(name, version.version).aliases),
        "promoted": decision["promote"],
        "gate": decision["reason"],
        "served": served,
    }


def _description(report: str, accuracy: float, versus: str, served, decision, table: str) -> str:
    """The version's description. Its first line is what the registry's version list shows, cut: the
    verdict and the figure, in plain words (no Markdown, which the list shows raw)."""
    verdict = "champion" if decision["promote"] else "stays candidate"
    return (
        f"Test accuracy {accuracy:.4f}: {verdict}. Served check {'passed' if served['passed'] else 'failed'}.\n\n"
        f"{report}\n"
        f"- test accuracy: {accuracy:.4f} vs {versus}\n"
        f"- served check: {serving.describe(served)}\n- gate: {decision['reason']}\n\n"
        f"Compression (export.json):\n\n{table}"
    )
