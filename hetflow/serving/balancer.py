"""The endpoint's load balancer: Debian's HAProxy, configured by hetflow and driven through its runtime API.

hetflow never relays a request. It writes one configuration at start and from then on changes only
runtime state over the admin socket, so no reload ever happens while traffic flows:

- backends are preallocated slots: ``m<i>`` holds every replica of model i's live versions (the traffic
  split, by server weight), ``m<i>s<j>`` holds only the replicas of the version in version slot j (what
  ``/versions/N`` and ``/labels/L`` reach). HAProxy 2.6 cannot create a backend at runtime, and a reload
  would reset counters and health states and close idle client connections (a request racing that close
  fails), so slots it is;
- replicas are dynamic servers (``add server`` / ``del server``, supported on ``balance roundrobin``);
- which model, version and label goes to which backend, and the TF Serving status JSON that
  ``GET /v1/models/NAME`` answers, are maps, replaced whole and atomically (``prepare``/``commit map``).
  HAProxy answers the status itself (``http-request return``): only the driver knows every version the
  endpoint holds, across processes, and that answer needs no model server up.
"""

import os
import re
import stat
import threading
import time
from pathlib import Path

from hetflow.serving.haproxy import BalancerError, HAProxy, write_private
from hetflow.serving.haproxy_config import HAProxyConfig, is_loopback
from hetflow.serving.replica_figures import replica_figures
from hetflow.serving.routing import MAPS, Model, Version, route_maps

LABELS = ("stable", "canary")
STATES = ("START", "LOADING", "AVAILABLE", "UNLOADING", "END")
MAX_WEIGHT = 256  # roundrobin's largest server weight: the finest split HAProxy can make
_MODEL_NAME = re.compile(r"^[A-Za-z0-9._-]{1,100}$")  # a URL path part, and valid in HAProxy's server names
_TOKEN_ALLOWED = re.compile(r"^[A-Za-z0-9._~+/=-]{16,}$")


class Balancer:
    """HAProxy in front of the model servers: start(), then the runtime API, then stop().

    Call start() from a thread that lives as long as the balancer (the main thread): the kernel's
    parent-death signal follows the thread that started HAProxy, not the process."""

    def __init__(
        self,
        run_dir,
        host="127.0.0.1",
        port=8501,
        max_body_bytes=8 * 1024 * 1024,
        token=None,
        max_models=8,
        max_versions=4,
        check_interval_ms=500,
        log_socket=None,
        log_format=None,
        edge_socket=None,
        metrics_socket=None,
    ):
        if not is_loopback(host) and not token:
            raise ValueError(f"host={host!r} is not loopback: a token is required (token=...)")
        if token is not None and not _TOKEN_ALLOWED.match(token):
            raise ValueError("token: at least 16 characters among A-Z a-z 0-9 . _ ~ + / = -")
        if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
            raise ValueError(f"max_body_bytes={max_body_bytes!r}: a positive integer of bytes")
        if bool(log_socket) != bool(log_format) or '"' in str(log_format or ""):
            raise ValueError(
                f"log_socket={log_socket!r}, log_format={log_format!r}: both or neither, "
                "the format without double quotes"
            )
        self.run_dir = Path(run_dir).resolve()
        self.host, self.port, self.max_body_bytes, self.token = host, port, max_body_bytes, token
        self.max_models, self.max_versions = max_models, max_versions
        self.check_interval_ms = check_interval_ms
        # Each request's line, as log_format spells it, to a Unix datagram socket: HAProxy's statistics
        # hold counters and averages, its log each answer (hetflow.serving.traffic_log reads it).
        self.log_socket, self.log_format = log_socket, log_format
        # the edge origin (hetflow.serving.edge_origin) answers /v1/edge/ on this Unix socket
        self.edge_socket = None if edge_socket is None else Path(edge_socket).resolve()
        # and hetflow.serving.traffic_metrics /metrics on this one (HAProxy's own are /metrics/haproxy)
        self.metrics_socket = None if metrics_socket is None else Path(metrics_socket).resolve()
        self._haproxy = HAProxy(self.run_dir)
        self.admin_socket, self.master_socket = self._haproxy.admin_socket, self._haproxy.master_socket
        self.config_path, self.log_path = self._haproxy.config_path, self._haproxy.log_path
        self._models = {}
        self._default_model = None
        self._published = {}
        # (backend, server) -> ((model, version, replica), socket, in the model's backend): read by
        # stats() without the lock, which a removal holds while its replicas drain
        self._owners = {}
        self._lock = threading.RLock()

    @property
    def url(self):
        return f"http://{self.host}:{self.port}"

    # ---- process ----

    def start(self, timeout_s=10.0):
        if self.running:
            raise ValueError(f"run_dir={str(self.run_dir)!r}: this balancer is already running")
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in MAPS:
            write_private(self._map_path(name), "")
        self._haproxy.start(self._config(), timeout_s)
        return self

    def stop(self, grace_s=5.0):
        """Soft stop (requests in flight finish, up to grace_s), then HAProxy's whole process group is
        killed. Raises no error: it runs on the way out of failures too."""
        self._haproxy.stop(grace_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def pid(self):
        return self._haproxy.pid

    @property
    def running(self):
        """HAProxy's master is alive (it exits if its worker dies: the owner should then stop and start)."""
        return self._haproxy.running

    # ---- configuration ----

    def _map_path(self, name):
        return self.run_dir / f"{name}.map"

    def _config(self):
        return HAProxyConfig(
            run_dir=self.run_dir,
            admin_socket=self.admin_socket,
            maps={name: self._map_path(name) for name in MAPS},
            host=self.host,
            port=self.port,
            max_body_bytes=self.max_body_bytes,
            token=self.token,
            max_models=self.max_models,
            max_versions=self.max_versions,
            log_socket=self.log_socket,
            log_format=self.log_format,
            edge_socket=self.edge_socket,
            metrics_socket=self.metrics_socket,
        ).text()

    # ---- runtime API ----

    def command(self, line, payload=None, master=False):
        """One runtime API command (several joined by ';'), its answer as text; master: to the master's CLI."""
        return self._haproxy.command(line, payload, master)

    def _expect_silent(self, line, payload=None):
        answer = self.command(line, payload).strip()
        if answer:
            raise BalancerError(f"haproxy refused {line.split(';')[0][:80]!r}: {answer.splitlines()[0]}")

    def _server_name(self, model, version, replica):
        return f"{model}-v{version}-r{replica}"

    def _servers(self, model_name, version_number):
        """(backend, server) pairs of a version's replicas: each in the model's and the version's backend."""
        model = self._models[model_name]
        version = model.versions[version_number]
        for replica in version.replicas.values():
            name = self._server_name(model_name, version_number, replica)
            yield f"m{model.slot}", name
            yield f"m{model.slot}s{version.slot}", name

    def model_of_backend(self, backend):
        """The model whose traffic backend ``m<i>`` (or version backend ``m<i>s<j>``) is, if any."""
        slot = backend.removeprefix("m").split("s")[0]
        return next((name for name, model in self._models.items() if str(model.slot) == slot), None)

    def _model(self, model_name):
        if model_name not in self._models:
            raise ValueError(f"model={model_name!r}: not served; served: {sorted(self._models)}")
        return self._models[model_name]

    def _version(self, model_name, version):
        model = self._model(model_name)
        if version not in model.versions:
            raise ValueError(f"version={version!r}: model {model_name!r} holds {sorted(model.versions)}")
        return model.versions[version]

    def set_version_servers(self, model_name, version, sockets):
        """The replicas of (model, version) are now these Unix sockets: new ones are added (checked, then
        enabled), missing ones drained and removed. A model's first version takes all its traffic; a
        later one takes none until set_weights gives it a share (it is reachable at /versions/N at once,
        for warming)."""
        if not _MODEL_NAME.match(str(model_name)):
            raise ValueError(f"model={model_name!r}: 1 to 100 characters among A-Z a-z 0-9 . _ - (a URL path part)")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r}: a non-negative integer")
        sockets = [str(Path(path).resolve()) for path in sockets]
        for path in sockets:
            if not (os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode)):
                raise ValueError(f"socket={path!r}: no Unix socket there (start the model server first)")
            if any(c.isspace() or c in ";#\\'\"" for c in path):
                raise ValueError(f"socket={path!r}: no spaces, quotes, ';', '#' or backslashes (HAProxy's CLI)")
        with self._lock:
            model = self._models.get(model_name) or self._new_model(model_name)
            entry = model.versions.get(version) or self._new_version(model, version)
            entry.percent = entry.percent or (100 if len(model.versions) == 1 else 0)
            for path in sockets:
                if path not in entry.replicas:
                    self._add_replica(model_name, model, version, entry, path)
            gone = [path for path in entry.replicas if path not in sockets]
            self._retire(model_name, version, gone)
            self._apply_weights(model_name)
            self._publish()

    def _new_model(self, model_name):
        free = sorted(set(range(self.max_models)) - {m.slot for m in self._models.values()})
        if not free:
            raise ValueError(f"model={model_name!r}: all {self.max_models} model slots are taken (max_models)")
        self._models[model_name] = Model(slot=free[0])
        return self._models[model_name]

    def _new_version(self, model, version):
        free = sorted(set(range(self.max_versions)) - {v.slot for v in model.versions.values()})
        if not free:
            raise ValueError(f"version={version}: all {self.max_versions} version slots are taken (max_versions)")
        model.versions[version] = Version(slot=free[0])
        return model.versions[version]

    def _add_replica(self, model_name, model, version, entry, path):
        replica = entry.next_replica
        entry.next_replica += 1
        name = self._server_name(model_name, version, replica)
        check = f"check inter {self.check_interval_ms} fastinter {max(100, self.check_interval_ms // 2)} fall 2 rise 1"
        added = []
        try:
            for backend, weight in ((f"m{model.slot}", 0), (f"m{model.slot}s{entry.slot}", 1)):
                answer = self.command(f"add server {backend}/{name} unix@{path} weight {weight} {check}")
                if "New server registered" not in answer:
                    raise BalancerError(f"haproxy refused server {path}: {answer.strip().splitlines()[0]}")
                added.append(backend)
                self._expect_silent(f"enable health {backend}/{name};enable server {backend}/{name}")
        except BaseException:
            for backend in added:  # no half-added replica: a retry must find its name free
                self.command(f"set server {backend}/{name} state maint;del server {backend}/{name}")
            raise
        entry.replicas[path] = replica
        self._owners[(f"m{model.slot}", name)] = (model_name, version, replica), path, True
        self._owners[(f"m{model.slot}s{entry.slot}", name)] = (model_name, version, replica), path, False

    def _retire(self, model_name, version, paths, timeout_s=30.0):
        """Drain these replicas (requests in flight finish, new ones go elsewhere), then delete them."""
        entry = self._models[model_name].versions[version]
        model = self._models[model_name]
        pairs = [  # HAProxy's proxy (the model's, the version's) and server names of each replica
            (proxy, self._server_name(model_name, version, entry.replicas[path]))
            for path in paths
            for proxy in (f"m{model.slot}", f"m{model.slot}s{entry.slot}")
        ]
        if not pairs:
            return
        self._expect_silent(";".join(f"set server {b}/{s} state drain" for b, s in pairs))
        deadline = time.monotonic() + timeout_s
        while any(row["scur"] != "0" or row["qcur"] not in ("", "0") for row in self._haproxy.server_rows(pairs)):
            if time.monotonic() > deadline:  # requests stuck past the timeout are cut: the caller chose it
                self._expect_silent(";".join(f"shutdown sessions server {b}/{s}" for b, s in pairs))
                break
            time.sleep(0.05)
        self._expect_silent(";".join(f"set server {b}/{s} state maint" for b, s in pairs))
        for backend, server in pairs:
            self._delete_server(backend, server, deadline + 5)
            self._owners.pop((backend, server), None)
        for path in paths:
            del entry.replicas[path]

    def _delete_server(self, backend, server, deadline):
        # a connection still closing holds the server for a moment
        while not (answer := self.command(f"del server {backend}/{server}").strip()).startswith("Server deleted"):
            if time.monotonic() > deadline:
                raise BalancerError(f"haproxy kept {backend}/{server}: {answer.splitlines()[0]}")
            time.sleep(0.05)

    def remove_version(self, model_name, version, timeout_s=30.0):
        """Stop routing to (model, version): its /versions/N and labels go at once, its replicas drain
        (up to timeout_s) and are deleted. The model goes with its last version."""
        with self._lock:
            model = self._model(model_name)
            entry = self._version(model_name, version)
            others = [v.percent for n, v in model.versions.items() if n != version]
            if entry.percent and others and not any(others):
                raise ValueError(
                    f"version={version}: it takes all the traffic of model {model_name!r}; "
                    "set_weights to the others first"
                )
            entry.state = "UNLOADING"
            model.labels = {label: v for label, v in model.labels.items() if v != version}
            self._publish(hidden=(model_name, version))
            self._retire(model_name, version, list(entry.replicas), timeout_s)
            del model.versions[version]
            if not model.versions:
                del self._models[model_name]
                if self._default_model == model_name:
                    self._default_model = None
            self._publish()

    def set_weights(self, model_name, percents):
        """Split the model's traffic between its versions: {version: percent}, summing to 100."""
        with self._lock:
            model = self._model(model_name)
            if (
                set(percents) != set(model.versions)
                or sum(percents.values()) != 100
                or any(not isinstance(p, int) or p < 0 for p in percents.values())
            ):
                raise ValueError(
                    f"percents={percents!r}: one non-negative integer per version of "
                    f"{sorted(model.versions)}, summing to 100"
                )
            for version, percent in percents.items():
                model.versions[version].percent = percent
            self._apply_weights(model_name)

    def _apply_weights(self, model_name):
        model = self._models[model_name]
        commands = []
        for version, entry in model.versions.items():
            count = len(entry.replicas)
            for replica in entry.replicas.values():
                weight = round(entry.percent * MAX_WEIGHT / 100 / count)
                weight = max(weight, 1) if entry.percent else 0
                commands.append(
                    f"set server m{model.slot}/{self._server_name(model_name, version, replica)} weight {weight}"
                )
        if commands:
            self._expect_silent(";".join(commands))

    def drain(self, model_name, version):
        """New requests for (model, version) go to its other versions; requests in flight finish."""
        with self._lock:
            entry = self._version(model_name, version)
            entry.state = "UNLOADING"
            self._expect_silent(
                ";".join(f"set server {b}/{s} state drain" for b, s in self._servers(model_name, version))
            )
            self._publish()

    def set_label(self, model_name, label, version):
        if label not in LABELS:
            raise ValueError(f"label={label!r}: one of {LABELS}")
        with self._lock:
            self._version(model_name, version)
            self._models[model_name].labels[label] = version
            self._publish()

    def set_version_state(self, model_name, version, state, message=""):
        """The state GET /v1/models/NAME reports for this version (TF Serving's names)."""
        if state not in STATES:
            raise ValueError(f"state={state!r}: one of {STATES}")
        with self._lock:
            entry = self._version(model_name, version)
            entry.state, entry.message = state, " ".join(str(message).split())  # a map value is one line
            self._publish()

    def set_default_model(self, model_name):
        """The model POST /invocations reaches; None: the only model, or a 400 where there are several."""
        with self._lock:
            if model_name is not None:
                self._model(model_name)
            self._default_model = model_name
            self._publish()

    # ---- maps ----

    def _publish(self, hidden=None):
        """Replace each changed map whole: a new version filled, then committed in one step, so that no
        request sees a half-written map."""
        for name, entries in route_maps(self._models, self._default_model, hidden).items():
            if self._published.get(name) == entries:
                continue
            path = self._map_path(name)
            answer = self.command(f"prepare map {path}")
            found = re.search(r"New version created: (\d+)", answer)
            if not found:
                raise BalancerError(f"haproxy refused to prepare {path.name}: {answer.strip()}")
            ver = found.group(1)
            if entries:
                payload = "\n".join(f"{key} {value}" for key, value in entries.items())
                self._expect_silent(f"add map @{ver} {path}", payload)
            self._expect_silent(f"commit map @{ver} {path}")
            self._published[name] = entries

    # ---- statistics ----

    def stats(self):
        """{(model, version, replica): requests, 2xx/4xx/5xx, mean response time (ms, HAProxy's last
        1024 requests), status UP/DOWN/DRAIN/MAINT, current sessions, socket}: the model's and the
        version's backends added together."""
        owners = dict(self._owners)  # a copy: stats() runs without the lock
        return replica_figures(self._haproxy.server_rows(list(owners)), owners)
