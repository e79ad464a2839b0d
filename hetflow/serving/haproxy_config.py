"""The configuration the balancer's HAProxy starts with, and keeps: everything that changes later
(servers, weights, routes, the status JSON) is runtime state behind it (``hetflow.serving.balancer``).

One frontend answers what needs no model server (the token's 401, the body limits' 411/413, 404s,
``GET /v1/models/NAME``'s status from a map, ``/metrics/haproxy``) and routes the rest by the maps: ``m<i>``,
model i's traffic split, and ``m<i>s<j>``, the version in its slot j, are preallocated backends."""

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path


def is_loopback(host):
    """Whether binding ``host`` keeps the endpoint on this machine (else it requires a token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _one_line(text):
    return json.dumps({"error": text})


@dataclass(frozen=True)
class HAProxyConfig:
    """What the configuration says: where the admin socket and the maps are, what it listens on, its
    limits, and where each request's log line goes (log_socket, in log_format), if anywhere."""

    run_dir: Path
    admin_socket: Path
    maps: dict  # map name -> its file
    host: str
    port: int
    max_body_bytes: int
    token: str | None
    max_models: int
    max_versions: int
    log_socket: Path | str | None = None
    log_format: str | None = None
    edge_socket: Path | None = None  # the edge origin's (hetflow.serving.edge_origin): /v1/edge/
    metrics_socket: Path | None = None  # per-version figures (hetflow.serving.traffic_metrics): /metrics

    def text(self):
        """The whole configuration, as HAProxy reads it at start."""
        run = self.run_dir
        sockets = (("edge_socket", self.edge_socket), ("metrics_socket", self.metrics_socket))
        for name, path in (("run_dir", run), *((name, path or "") for name, path in sockets)):
            if any(c in str(path) for c in " \"'#\\"):
                raise ValueError(f"{name}={str(path)!r}: no spaces, quotes, '#' or backslashes (HAProxy's config)")
        lines = [
            "global",
            f"    stats socket {self.admin_socket} mode 600 level admin expose-fd listeners",
            "    stats timeout 30s",
            "    hard-stop-after 10s",
            # by default a second HAProxy (another endpoint) could bind the same port and take half the traffic
            "    noreuseport",
            "    log stderr format raw local0 info",
            "    maxconn 4096",
            # L7 retries copy the request into one buffer; 64 KiB covers typical predict bodies
            "    tune.bufsize 65536",
            "defaults",
            "    mode http",
            # haproxy.log: HAProxy's notices (servers up and down), and the requests that went wrong
            # (retried or failed, with their termination flags)
            "    log global",
            "    option httplog",
            "    option dontlog-normal",
            "    timeout connect 2s",
            "    timeout client 60s",
            "    timeout server 60s",
            "    timeout http-request 10s",
            "    timeout queue 10s",
            "    timeout http-keep-alive 10s",
            "    retries 3",
            "    option redispatch 1",
            "    retry-on conn-failure empty-response junk-response 503",
            # a new Unix-socket connection per request costs little (measured faster than reuse with the
            # stdlib servers), and no request then races a model server closing an idle connection
            "    http-reuse never",
        ]
        for code, reason in (
            (503, "no replica of this model or version is available"),
            (502, "a model server gave no valid answer"),
            (504, "a model server did not answer in time"),
            (400, "malformed HTTP request"),
            (408, "the request took too long to arrive"),
        ):
            lines.append(f"    http-error status {code} content-type application/json string '{_one_line(reason)}'")
        lines += self._frontend()
        for model_slot in range(self.max_models):
            lines += self._backend(f"m{model_slot}")
            for version_slot in range(self.max_versions):
                lines += self._backend(f"m{model_slot}s{version_slot}")
        if self.edge_socket:
            lines += ["backend edge", f"    server origin unix@{self.edge_socket}"]
        if self.metrics_socket:
            lines += ["backend metrics", f"    server origin unix@{self.metrics_socket}"]
        return "\n".join(lines) + "\n"

    def _request_log(self):
        """Every request to the owner's socket in its format, where it asked: the frontend logs requests,
        the backends their servers' notices, so these go on the frontend only."""
        if not self.log_socket:
            return []
        return [
            "    no log",
            f"    log unix@{self.log_socket} len 1024 format raw local0 info",
            f'    log-format "{self.log_format}"',
            "    no option dontlog-normal",
        ]

    def _frontend(self):
        maps = self.maps
        json_reply = "content-type application/json"
        lines = ["frontend endpoint", f"    bind {self.host}:{self.port}", *self._request_log()]
        if self.token:
            lines.append(
                f"    http-request return status 401 {json_reply} string "
                f"'{_one_line('missing or wrong Authorization: Bearer <token>')}' "
                f'unless {{ req.hdr(authorization) -m str "Bearer {self.token}" }}'
            )
        lines += [
            f"    http-request return status 413 {json_reply} string "
            f"'{_one_line(f'the body is over the limit of {self.max_body_bytes} bytes')}' "
            f"if {{ req.hdr_val(content-length) gt {self.max_body_bytes} }}",
            # a chunked body's size is unknown until read whole: the limit could not be kept
            f"    http-request return status 411 {json_reply} string "
            f"'{_one_line('send the body with a Content-Length')}' "
            "if { req.hdr(transfer-encoding) -m found } !{ req.hdr(content-length) -m found }",
            # HAProxy's own per-server figures; /metrics is the per-version one where the endpoint serves it
            "    http-request use-service prometheus-exporter if { path /metrics/haproxy }",
            *(
                ["    use_backend metrics if METH_GET { path /metrics }"]
                if self.metrics_socket
                else ["    http-request use-service prometheus-exporter if { path /metrics }"]
            ),
            "    acl models_path path_beg /v1/models/",
            "    acl invocations path /invocations",
            "    acl status_path path_reg ^/v1/models/[^/:]+(/(versions|labels)/[^/:]+)?$",
            "    http-request set-var(txn.model) path,field(4,/),field(1,:) if models_path",
            "    http-request set-var(txn.backend) var(txn.model),map(" + str(maps["models"]) + ") if models_path",
            f"    http-request return status 404 {json_reply} lf-string "
            '\'{"error": "no model named %[var(txn.model),json(utf8s)] is served"}\' '
            "if models_path !{ var(txn.backend) -m found }",
            "    http-request set-var(txn.selector) path,field(4,/,3),field(1,:) if models_path",
            f"    http-request return status 200 {json_reply} lf-string '%[var(txn.selector),map({maps['status']})]' "
            f"if METH_GET status_path {{ var(txn.selector),map({maps['status']}) -m found }}",
            "    acl selects path,field(5,/) -m str versions labels",
            f"    http-request set-var(txn.version_backend) var(txn.selector),map({maps['selectors']}) "
            "if models_path selects",
            f"    http-request return status 404 {json_reply} lf-string "
            '\'{"error": "model %[var(txn.model),json(utf8s)] has no %[path,field(5,/)] '
            "%[path,field(6,/),field(1,:),json(utf8s)]\"}' "
            "if models_path selects !{ var(txn.version_backend) -m found }",
            f"    http-request set-var(txn.backend) str(default),map({maps['invocations']}) if invocations",
            f"    http-request return status 400 {json_reply} string "
            f"'{_one_line('several models are served and none is the default: use POST /v1/models/<name>:predict')}' "
            f"if invocations !{{ var(txn.backend) -m found }} {{ str(several),map({maps['invocations']}) -m found }}",
            f"    http-request return status 404 {json_reply} string '{_one_line('no model is served')}' "
            "if invocations !{ var(txn.backend) -m found }",
            *(["    use_backend edge if { path_beg /v1/edge/ }"] if self.edge_socket else []),
            "    use_backend %[var(txn.version_backend)] if models_path selects",
            "    use_backend %[var(txn.backend)] if models_path || invocations",
            "    default_backend no_route",
            "backend no_route",
            f"    http-request return status 404 {json_reply} string "
            f"'{_one_line('no such path: use /v1/models/<name>[:predict], /invocations or /metrics')}'",
        ]
        return lines

    @staticmethod
    def _backend(name):
        return [
            f"backend {name}",
            "    balance roundrobin",
            "    option httpchk",
            "    http-check send meth GET uri /ping",
        ]
