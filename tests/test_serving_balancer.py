"""hetflow.serving.balancer: real HAProxy (Debian's) in front of small stdlib HTTP servers on Unix sockets
that answer with their own name (a stand-in for the model servers, which are tested on their own)."""

import http.client
import json
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from hetflow.serving.balancer import Balancer
from hetflow.serving.server import free_port

pytestmark = pytest.mark.skipif(not Path("/usr/sbin/haproxy").exists(), reason="Debian's haproxy: make sandbox")

NAMED_SERVER = textwrap.dedent("""
    import http.server, json, os, socketserver, sys, time
    name, path = sys.argv[1], sys.argv[2]

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *args): pass
        def address_string(self): return "unix"
        def answer(self):  # headers and body in one write, as a real server's response
            body = name.encode()
            self.wfile.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\n"
                             b"Content-Length: %d\\r\\n\\r\\n%s" % (len(body), body))
        def do_GET(self): self.answer()
        def do_POST(self):
            request = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            time.sleep(json.loads(request or b"{}").get("sleep", 0))
            self.answer()

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True
        def handle_error(self, request, address): pass  # HAProxy's health checks hang up early

    if os.path.exists(path): os.unlink(path)
    server = Server(path, Handler)
    print("ready", flush=True)
    server.serve_forever()
""")


class NamedServers:
    """Stdlib HTTP servers, one process each, keyed by name; each answers its name."""

    def __init__(self, folder):
        self.folder, self.procs = Path(folder), {}

    def start(self, name):
        path = self.folder / f"{name}.sock"
        proc = subprocess.Popen([sys.executable, "-c", NAMED_SERVER, name, str(path)], stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        self.procs[name] = proc
        return str(path)

    def kill(self, name):
        self.procs[name].kill()
        self.procs[name].wait()

    def stop_all(self):
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def servers(tmp_path):
    fleet = NamedServers(tmp_path)
    yield fleet
    fleet.stop_all()


@pytest.fixture
def balancer(tmp_path):
    with Balancer(tmp_path / "lb", port=free_port(), max_body_bytes=1000, check_interval_ms=200) as lb:
        yield lb


def call(lb, path, body=None, headers=None, conn=None):
    """(status, body text) of one request; body None: GET, else POST of that JSON."""
    own = conn is None
    conn = conn or http.client.HTTPConnection(lb.host, lb.port, timeout=10)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request("GET" if body is None else "POST", path, body=data, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        if own:
            conn.close()


class Load:
    """Closed-loop clients on keep-alive connections, for the length of a with block: counts answers by
    replica name, and failures (when, what)."""

    def __init__(self, lb, path, clients=4):
        self.lb, self.path, self.answers, self.failures = lb, path, Counter(), []
        self.running = True
        self.threads = [threading.Thread(target=self._client) for _ in range(clients)]

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        for thread in self.threads:
            thread.join()

    @property
    def total(self):
        return sum(self.answers.values())

    def _client(self):
        conn = http.client.HTTPConnection(self.lb.host, self.lb.port, timeout=10)
        while self.running:
            try:
                status, text = call(self.lb, self.path, {"instances": [[1.0]]}, conn=conn)
            except (OSError, http.client.HTTPException) as error:
                self.failures.append((time.monotonic(), repr(error)))
                conn.close()
                continue
            if status == 200:
                self.answers[text] += 1
            else:
                self.failures.append((time.monotonic(), f"{status} {text}"))
        conn.close()


def test_weights_split_traffic_and_versions_and_labels_route_to_one_version(balancer, servers):
    balancer.set_version_servers("mnist", 1, [servers.start("v1a"), servers.start("v1b")])
    balancer.set_version_servers("mnist", 2, [servers.start("v2a")])
    balancer.set_weights("mnist", {1: 90, 2: 10})
    conn = http.client.HTTPConnection(balancer.host, balancer.port)
    answers = Counter(call(balancer, "/v1/models/mnist:predict", {}, conn=conn)[1] for _ in range(500))
    canary_share = answers["v2a"] / 500
    assert 0.08 <= canary_share <= 0.12, answers  # roundrobin on weights 115/115/26 gives 10.2 %
    assert abs(answers["v1a"] - answers["v1b"]) <= 5, answers  # the stable share spread over both replicas

    assert {call(balancer, "/v1/models/mnist/versions/2:predict", {}, conn=conn)[1] for _ in range(20)} == {"v2a"}
    assert {call(balancer, "/v1/models/mnist/versions/1:predict", {}, conn=conn)[1] for _ in range(20)} == {
        "v1a",
        "v1b",
    }
    balancer.set_label("mnist", "canary", 2)
    balancer.set_label("mnist", "stable", 1)
    assert {call(balancer, "/v1/models/mnist/labels/canary:predict", {}, conn=conn)[1] for _ in range(20)} == {"v2a"}
    assert {call(balancer, "/v1/models/mnist/labels/stable:predict", {}, conn=conn)[1] for _ in range(20)} == {
        "v1a",
        "v1b",
    }
    balancer.set_label("mnist", "canary", 1)  # a label moves at runtime
    assert {call(balancer, "/v1/models/mnist/labels/canary:predict", {}, conn=conn)[1] for _ in range(10)} == {
        "v1a",
        "v1b",
    }

    with pytest.raises(ValueError, match="label='beta'"):
        balancer.set_label("mnist", "beta", 1)
    with pytest.raises(ValueError, match="summing to 100"):
        balancer.set_weights("mnist", {1: 90, 2: 20})
    balancer.set_weights("mnist", {1: 100, 2: 0})
    with pytest.raises(ValueError, match="it takes all the traffic of model 'mnist'"):
        balancer.remove_version("mnist", 1)


def test_status_json_lists_every_version_and_its_state(balancer, servers):
    balancer.set_version_servers("mnist", 3, [servers.start("v3")])
    balancer.set_version_servers("mnist", 4, [servers.start("v4")])
    balancer.set_version_state("mnist", 4, "LOADING")
    status, text = call(balancer, "/v1/models/mnist")
    assert status == 200
    assert json.loads(text) == {
        "model_version_status": [
            {"version": "4", "state": "LOADING", "status": {"error_code": "OK", "error_message": ""}},
            {"version": "3", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}},
        ]
    }
    assert [
        v["version"] for v in json.loads(call(balancer, "/v1/models/mnist/versions/3")[1])["model_version_status"]
    ] == ["3"]
    balancer.set_weights("mnist", {3: 0, 4: 100})
    balancer.drain("mnist", 3)
    listed = json.loads(call(balancer, "/v1/models/mnist")[1])["model_version_status"]
    states = {v["version"]: v["state"] for v in listed}
    assert states == {"3": "UNLOADING", "4": "LOADING"}
    balancer.remove_version("mnist", 3)
    balancer.set_version_state("mnist", 4, "END", "failed its check:\n3 of 20 answers differ")
    assert json.loads(call(balancer, "/v1/models/mnist")[1]) == {
        "model_version_status": [
            {
                "version": "4",
                "state": "END",
                "status": {"error_code": "UNKNOWN", "error_message": "failed its check: 3 of 20 answers differ"},
            }
        ]
    }


def test_drain_lets_the_request_in_flight_finish_and_sends_new_ones_elsewhere(balancer, servers):
    balancer.set_version_servers("mnist", 1, [servers.start("old")])
    balancer.set_version_servers("mnist", 2, [servers.start("new")])
    balancer.set_weights("mnist", {1: 50, 2: 50})
    slow = {}
    in_flight = threading.Thread(
        target=lambda: slow.update(answer=call(balancer, "/v1/models/mnist/versions/1:predict", {"sleep": 1.5}))
    )
    in_flight.start()
    time.sleep(0.3)
    balancer.drain("mnist", 1)
    assert {call(balancer, "/v1/models/mnist:predict", {})[1] for _ in range(20)} == {"new"}
    assert balancer.stats()[("mnist", 1, 0)]["status"] == "DRAIN"
    assert balancer.stats()[("mnist", 1, 0)]["sessions"] == 1  # the slow one, still on the drained server
    remover = threading.Thread(target=balancer.remove_version, args=("mnist", 1))
    remover.start()  # it waits for the slow request; stats() must not wait with it
    time.sleep(0.1)
    started = time.monotonic()
    assert balancer.stats()[("mnist", 1, 0)]["sessions"] == 1 and time.monotonic() - started < 0.3
    in_flight.join()
    remover.join()
    assert slow["answer"] == (200, "old")
    assert set(balancer.stats()) == {("mnist", 2, 0)}


def _swap(balancer, servers, old, new):
    """A rollout's steps on the balancer: add the new version, canary, promote, remove the old one while
    a slow request is in flight on it."""
    balancer.set_version_servers("mnist", new, [servers.start(f"v{new}a"), servers.start(f"v{new}b")])
    balancer.set_weights("mnist", {old: 50, new: 50})
    time.sleep(0.4)
    balancer.set_weights("mnist", {old: 0, new: 100})
    slow = {}
    in_flight = threading.Thread(
        target=lambda: slow.update(answer=call(balancer, f"/v1/models/mnist/versions/{old}:predict", {"sleep": 0.6}))
    )
    in_flight.start()
    time.sleep(0.2)
    balancer.remove_version("mnist", old)  # waits for the slow request on it
    assert slow["answer"][0] == 200 and slow["answer"][1].startswith(f"v{old}")
    in_flight.join()


def test_adding_and_removing_versions_under_load_loses_no_request(balancer, servers):
    balancer.set_version_servers("mnist", 1, [servers.start("v1")])
    with Load(balancer, "/v1/models/mnist:predict") as load:
        time.sleep(0.5)
        _swap(balancer, servers, 1, 2)
        _swap(balancer, servers, 2, 3)
        # Both new replicas take traffic once their first health check passes (0.5 s apart, or later
        # on a busy machine): waited for, up to 5 s, rather than assumed after a fixed pause.
        deadline = time.monotonic() + 5
        while not {"v3a", "v3b"} <= set(load.answers) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert load.failures == []
    assert load.total > 200 and set(load.answers) == {"v1", "v2a", "v2b", "v3a", "v3b"}, load.answers
    assert set(balancer.stats()) == {("mnist", 3, 0), ("mnist", 3, 1)}


def test_a_killed_servers_requests_are_retried_on_the_others(balancer, servers):
    """Only requests the killed replica held may fail (one per client at most), and none after. Its
    socket is reset where it held unread bytes, and HAProxy 2.6 replays a request after a refused
    connection or a clean close but not after a read error (http_wait_for_response); the client of a
    kept-alive connection then sees it closed, a new connection a 502."""
    clients = 6
    balancer.set_version_servers("mnist", 1, [servers.start(name) for name in ("r0", "r1", "r2")])
    with Load(balancer, "/v1/models/mnist:predict", clients=clients) as load:
        time.sleep(0.5)
        servers.kill("r1")
        killed_at = time.monotonic()
        time.sleep(1.5)
    total = load.total
    late = [when for when, _ in load.failures if when > killed_at + 0.2]
    assert len(load.failures) <= clients and late == [], f"{len(load.failures)} of {total}: {load.failures[:3]}"
    assert total > 500 and load.answers["r0"] > 100 and load.answers["r2"] > 100
    assert balancer.stats()[("mnist", 1, 1)]["status"] == "DOWN"
    # haproxy.log holds only the abnormal requests: the retried (status, then +retries) and the failed,
    # but for those closed silently on a kept-alive connection (HAProxy logs none of its abort_keep_alive)
    logged = re.findall(r"\] endpoint \S+ \S+ (-?\d+) .* \d+/\d+/\d+/\d+/\+?(\d+) ", balancer.log_path.read_text())
    retried = sum(1 for status, retries in logged if status == "200" and int(retries) > 0)
    assert sum(1 for status, _ in logged if status != "200") <= len(load.failures) and retried > 0
    print(f"killed replica: {len(load.failures)} of {total} requests failed, {retried} retried on the others")


def test_refusals_are_one_line_json(tmp_path, balancer, servers):
    v1 = servers.start("v1")
    balancer.set_version_servers("mnist", 1, [v1])
    for path, body, code, words in [
        ("/v1/models/nope:predict", {}, 404, "no model named nope"),
        ("/v1/models/mnist/versions/7:predict", {}, 404, "has no versions 7"),
        ("/v1/models/mnist/labels/canary:predict", {}, 404, "has no labels canary"),
        ("/v1/models/mnist:predict", {"instances": "x" * 1000}, 413, "over the limit of 1000 bytes"),
        ("/elsewhere", None, 404, "/v1/models/<name>"),
    ]:
        status, text = call(balancer, path, body)
        assert (status, "\n" not in text.strip()) == (code, True), (path, text)
        assert words in json.loads(text)["error"]

    with socket.create_connection((balancer.host, balancer.port)) as raw:  # a chunked body, sent at once
        raw.sendall(
            b"POST /v1/models/mnist:predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\n{}\r\n0\r\n\r\n"
        )
        head, _, body = raw.recv(4096).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 411") and json.loads(body) == {"error": "send the body with a Content-Length"}

    with pytest.raises(ValueError, match="model='a b': 1 to 100 characters"):
        balancer.set_version_servers("a b", 1, [v1])
    with pytest.raises(ValueError, match="no Unix socket there"):
        balancer.set_version_servers("mnist", 2, [str(tmp_path / "absent.sock")])
    with pytest.raises(ValueError, match="host='0.0.0.0' is not loopback: a token is required"):
        Balancer(tmp_path / "open", host="0.0.0.0")
    token = "s3cret-token-0123456789"
    with Balancer(tmp_path / "guarded", port=free_port(), token=token) as guarded:
        guarded.set_version_servers("mnist", 1, [v1])
        status, text = call(guarded, "/v1/models/mnist:predict", {})
        assert status == 401 and "Bearer" in json.loads(text)["error"]
        assert call(guarded, "/v1/models/mnist:predict", {}, {"Authorization": "Bearer wrong-token-000000"})[0] == 401
        assert call(guarded, "/v1/models/mnist:predict", {}, {"Authorization": f"Bearer {token}"}) == (200, "v1")


def test_invocations_reach_the_default_model(balancer, servers):
    balancer.set_version_servers("mnist", 1, [servers.start("mnist1")])
    assert call(balancer, "/invocations", {}) == (200, "mnist1")  # the only model
    balancer.set_version_servers("fashion", 5, [servers.start("fashion5")])
    status, text = call(balancer, "/invocations", {})
    assert status == 400 and "/v1/models/<name>:predict" in json.loads(text)["error"]
    balancer.set_default_model("fashion")
    assert call(balancer, "/invocations", {}) == (200, "fashion5")


def test_every_request_reaches_the_owners_log_socket_in_its_format(tmp_path, servers):
    sink_path = tmp_path / "traffic.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sink:
        sink.bind(str(sink_path))
        sink.settimeout(5)
        with Balancer(tmp_path / "lb", port=free_port(), log_socket=sink_path, log_format="%b %s %ST %rc") as lb:
            lb.set_version_servers("mnist", 7, [servers.start("v7")])
            for path in ("/v1/models/mnist:predict", "/v1/models/mnist/versions/7:predict", "/v1/models/nope:predict"):
                call(lb, path, {})
            lines = [sink.recv(2048).decode().strip() for _ in range(3)]
            assert lines == ["m0 mnist-v7-r0 200 0", "m0s0 mnist-v7-r0 200 0", "endpoint <NOSRV> 404 0"]
            assert "POST" not in lb.log_path.read_text()  # haproxy.log keeps HAProxy's own notices only
    with pytest.raises(ValueError, match="both or neither"):
        Balancer(tmp_path / "half", log_socket=sink_path)


def test_metrics_count_each_server(balancer, servers):
    balancer.set_version_servers("mnist", 1, [servers.start("v1")])
    for _ in range(7):
        call(balancer, "/v1/models/mnist:predict", {})
    for _ in range(3):
        call(balancer, "/v1/models/mnist/versions/1:predict", {})
    status, text = call(balancer, "/metrics")
    assert status == 200
    assert 'haproxy_server_http_responses_total{proxy="m0",server="mnist-v1-r0",code="2xx"} 7' in text
    assert 'haproxy_server_http_responses_total{proxy="m0s0",server="mnist-v1-r0",code="2xx"} 3' in text
    figures = balancer.stats()[("mnist", 1, 0)]
    assert (figures["requests"], figures["2xx"], figures["status"]) == (10, 10, "UP")
