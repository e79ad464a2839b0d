"""``hetflow serve``: an endpoint per registered model that follows its ``champion`` alias.

The parts, each in a room of its own::

    Follower (follower.py) ── champion moved ──► Rollout (rollout.py) ── judged by ── policy.py
                                                    │ drives
                    client ── 127.0.0.1:8501 ──► Balancer (balancer.py: HAProxy, configured and
                                                    │ steered through its runtime API)
                                                    ▼ Unix sockets
                                  VersionServers (replicas.py): sandboxed model servers
                                  (model_server/), one group per version

This module holds them together: it starts the balancer and the log of its answers, serves each
model's champion, rolls out each new one, writes every rollout on the model version and as a run
of the ``hetflow-deployments`` experiment, restarts a replica found dead, and on the way out
(return, an exception, SIGTERM, Ctrl-C) stops every process it started.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlflow.entities import Metric

from hetflow.registry import store
from hetflow.serving import control, policy, traffic_log
from hetflow.serving.balancer import Balancer
from hetflow.serving.edge_origin import EdgeOrigin
from hetflow.serving.follower import CHAMPION, POLL_SECONDS, Follower, Move
from hetflow.serving.replicas import VersionServers
from hetflow.serving.rollout import Rollout, RolloutFailed
from hetflow.serving.server import ServingError
from hetflow.serving.traffic_metrics import MetricsOrigin, TrafficMetrics

log = logging.getLogger("hetflow.serving")

DEPLOYMENTS_EXPERIMENT = "hetflow-deployments"
START_DEADLINE_SECONDS = 180.0


class Endpoint:
    def __init__(
        self,
        tracking_uri: str,
        folder: Path,
        host: str = "127.0.0.1",
        port: int = 8501,
        models: tuple[str, ...] = (),
        replicas: int = 1,
        limits: policy.Limits | None = None,
        token: str | None = None,
        control_socket: Path | None | str = "home",
    ):
        self.tracking_uri = tracking_uri
        self.client = store.client(tracking_uri)
        self.folder = folder
        self.replicas = replicas
        self.limits = limits or policy.Limits()
        self.start_deadline_seconds = START_DEADLINE_SECONDS
        self.follower = Follower(self.client, models)
        self.metrics = TrafficMetrics(lambda backend: self.balancer.model_of_backend(backend))
        self.traffic = traffic_log.TrafficLog(folder / "haproxy-log.sock", on_answer=self.metrics.observe)
        self.metrics_origin = MetricsOrigin(self.metrics, folder / "metrics.sock")  # GET /metrics, per version
        self.edge = EdgeOrigin(self.client, folder / "edge", models)  # GET /v1/edge/<model>/...: the TFLite champion
        self.balancer = Balancer(
            folder / "balancer",
            host=host,
            port=port,
            token=token,
            log_socket=self.traffic.socket_path,
            log_format=traffic_log.LOG_FORMAT,
            edge_socket=self.edge.socket_path,
            metrics_socket=self.metrics_origin.socket_path,
        )
        self.serving: dict[str, tuple[str, VersionServers]] = {}  # model → (version, its servers)
        self.failed: set[tuple[str, str]] = set()  # candidates not tried again until champion moves on
        # The deploy DAG's way in (control.py), under HETFLOW_HOME unless given (None: none); the DAG
        # follows the rollouts kept here, by (model, version).
        if control_socket == "home":
            control_socket = control.socket_path()
        self.control = control.ControlServer(control_socket, self.rollout_state) if control_socket else None
        self.rollouts: dict[tuple[str, str], Rollout] = {}
        self.wake = threading.Event()  # set by a request: read the aliases now, not at the next poll

    def serve(self, stop: threading.Event, ready: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set; every process started is stopped before this returns."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            self.traffic.start()
            self.edge.start()
            self.metrics_origin.start()
            self.balancer.start()
            self._start_control()
            while not stop.is_set():
                for move in self.follower.moves():
                    if (move.model, move.version) not in self.failed:
                        self._roll_out(move)
                if ready is not None:
                    ready.set()
                self._heal()
                self._pause(stop)
        finally:
            self.close()

    def _start_control(self) -> None:
        if self.control is None:
            return
        try:
            self.control.start()
        except (control.SocketTaken, OSError) as taken:  # a second endpoint on one home, a path over 107 bytes
            log.warning("no control socket (%s): this endpoint follows champion without the deploy DAG", taken)
            self.control = None

    def _pause(self, stop: threading.Event) -> None:
        """Until the next poll, stop, or a control request waking the follower."""
        deadline = time.monotonic() + POLL_SECONDS
        while not (stop.is_set() or self.wake.is_set()) and time.monotonic() < deadline:
            stop.wait(0.1)
        self.wake.clear()

    def rollout_state(self, model: str, version: str) -> dict[str, Any]:
        """What the control socket answers: the rollout of (model, version), started by the follower
        when ``champion`` named it; asked before that, the follower reads the aliases at once."""
        rollout = self.rollouts.get((model, version))
        if rollout is not None:
            record = json.loads(json.dumps(rollout.record))  # a copy: the rollout's thread goes on writing it
            ended = "seconds" in record and "outcome" in record
            return {"state": record["outcome"] if ended else "running", "record": record}
        if self.follower.names and model not in self.follower.names:
            return {"state": "refused", "reason": f"this endpoint serves only {', '.join(self.follower.names)}"}
        champion = self._champion(model)
        if champion != version:
            return {
                "state": "refused",
                "reason": f"champion of {model} names {f'v{champion}' if champion else 'no version'}, not v{version}: "
                "the endpoint rolls out the champion (move the alias to deploy another version)",
            }
        self.wake.set()
        return {"state": "pending"}

    def _roll_out(self, move: Move) -> None:
        rollout = Rollout(self, move.model, move.version, move.previous, self.limits)
        self.rollouts[(move.model, move.version)] = rollout
        try:
            record = rollout.run()
            log.info(
                "%s v%s serves now (was %s), in %.1f s",
                move.model,
                move.version,
                move.previous or "nothing",
                record["seconds"],
            )
        except RolloutFailed as failure:
            self.failed.add((move.model, move.version))
            log.warning("%s v%s was not deployed: %s", move.model, move.version, failure)
        self._write_record(rollout)

    def version_servers(self, model: str, version: str) -> VersionServers:
        return VersionServers(
            f"models:/{model}/{version}", self.tracking_uri, self.folder / model / f"v{version}", replicas=self.replicas
        )

    def serving_now(self, model: str, version: str, servers: VersionServers) -> VersionServers | None:
        """``version`` is the one ``model`` serves now; returns the servers of the one it replaced."""
        replaced = self.serving.get(model)
        self.serving[model] = (version, servers)
        self.follower.served_now(model, version)
        return replaced[1] if replaced else None

    def holds(self, model: str, version: str) -> bool:
        """Whether the balancer routes to this version (at any share)."""
        return any(key[:2] == (model, int(version)) for key in self.balancer.stats())

    def answers_of(self, model: str, version: str, since: float) -> list[traffic_log.Answer]:
        """What the version's replicas answered through the balancer since ``since`` (monotonic)."""
        prefix = self.balancer._server_name(model, int(version), 0).removesuffix("0")
        return [answer for answer in self.traffic.since(since) if answer.server.startswith(prefix)]

    def champion_back(self, model: str, version: str, previous: str | None, reason: str) -> None:
        """``champion`` back on the version served before, the reason on the candidate."""
        when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if previous is not None and self._champion(model) == version:
            self.client.set_registered_model_alias(model, CHAMPION, previous)
            self.follower.served_now(model, previous)
        candidate = self.client.get_model_version(model, version)
        note = f"Rolled back by the endpoint at {when}: {reason}."
        self.client.update_model_version(model, version, description=f"{note}\n\n{candidate.description or ''}".strip())
        self.client.set_model_version_tag(model, version, "deployment.outcome", "rolled back")
        self.client.set_model_version_tag(model, version, "deployment.reason", reason)

    def _champion(self, model: str) -> str | None:
        version = self.client.get_registered_model(model).aliases.get(CHAMPION)
        return None if version is None else str(version)  # MLflow's SQL store gives an int

    def _heal(self) -> None:
        """A replica found dead is restarted; the balancer's health checks took it out meanwhile."""
        for model, (version, servers) in self.serving.items():
            for replica in servers.dead_replicas():
                log.warning("%s v%s: replica %d had exited; restarting it", model, version, replica)
                try:
                    servers.restart(replica, time.monotonic() + self.start_deadline_seconds)
                except ServingError as error:  # tried again at the next poll; the others serve meanwhile
                    log.warning("%s v%s: replica %d did not restart: %s", model, version, replica, error)

    def _write_record(self, rollout: Rollout) -> None:
        """The rollout on its model version (tags) and as a run of the deployments experiment, with
        each version's requests, errors and p99 latency second by second as its charts."""
        record = rollout.record
        model, version = record["model"], record["version"]
        sentence = describe(record)
        try:
            self.client.set_model_version_tag(model, version, "deployment", sentence)
            experiment = self.client.get_experiment_by_name(DEPLOYMENTS_EXPERIMENT)
            kind = {store.EXPERIMENT_KIND_TAG: store.MODEL_TRAINING}
            experiment_id = (
                experiment.experiment_id
                if experiment
                else store.create_experiment(self.client, DEPLOYMENTS_EXPERIMENT, kind)
            )
            run = self.client.create_run(
                experiment_id,
                run_name=f"{model} v{record.get('previous') or '-'} → v{version}",
                tags={"outcome": record.get("outcome", ""), "model": model, "version": version},
            )
            charts = self._charts(rollout)
            for start in range(0, len(charts), 1000):  # MLflow's limit per batch
                self.client.log_batch(run.info.run_id, metrics=charts[start : start + 1000])
            self.client.log_text(run.info.run_id, sentence, "rollout.txt")
            self.client.log_dict(run.info.run_id, record, "rollout.json")
            self.client.set_terminated(run.info.run_id, "FINISHED" if record.get("outcome") == "promoted" else "FAILED")
            self.client.set_model_version_tag(model, version, "deployment.run_id", run.info.run_id)
        except Exception:  # the endpoint keeps serving when the registry cannot be written
            log.exception("could not record the rollout of %s v%s", model, version)

    def _charts(self, rollout: Rollout) -> list[Metric]:
        now = int(time.time() * 1000)
        metrics = []
        for version in filter(None, (rollout.previous, rollout.version)):
            seconds = traffic_log.per_second(self.answers_of(rollout.model, version, rollout.started), rollout.started)
            for second, figures in seconds.items():
                for name in ("requests", "errors", "p99_ms"):
                    if figures[name] is not None:
                        metrics.append(Metric(f"{name}/v{version}", round(figures[name], 2), now, second))
        return metrics

    def close(self) -> None:
        if self.control is not None:
            self.control.stop()
        for _, servers in list(self.serving.values()):
            servers.stop()
        self.serving.clear()
        self.balancer.stop()
        self.edge.stop()
        self.metrics_origin.stop()
        self.traffic.stop()


def describe(record: dict[str, Any]) -> str:
    """The rollout in one line, for the version page."""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    steps = ", ".join(
        f"{step['share']}% ({step['canary_requests']} requests, p99 {_ms(step['canary_p99_ms'])})"
        for step in next((s.get("canary_steps", []) for s in record["steps"] if s["step"] == "canary"), [])
    )
    outcome = record.get("outcome", "not finished")
    head = (
        f"{outcome} at {when}, after v{record['previous']}"
        if record.get("previous")
        else f"{outcome} at {when}, first version served"
    )
    tail = f"; canary {steps}" if steps else ""
    reason = f": {record['reason']}" if record.get("reason") else ""
    return f"{head}{reason}{tail}; {record.get('seconds', 0):.1f} s in all"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
