"""A replica that floods its output: one line of tens of megabytes, no newline until the end. What the
pipeline keeps of it, in memory and in its log, is one line of bounded length."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc

from hetflow.cluster.output_lines import LINE_LIMIT, cut_lines

FLOOD = 48 * 1024 * 1024

# Writes FLOOD bytes without a newline, a megabyte at a time, to argv[1] (a file or "-": stdout),
# then one ordinary line; with argv[2], then records that it exited 0 there, as a keeper does.
_FLOODER = """
import json, sys
out = sys.stdout.buffer if sys.argv[1] == "-" else open(sys.argv[1], "ab", buffering=0)
for _ in range({megabytes}):
    out.write(b"x" * 1024 * 1024)
out.write(b"\\nafter the flood\\n")
out.flush()
if len(sys.argv) > 2:
    open(sys.argv[2], "w").write(json.dumps({{"exit_code": 0}}))
""".format(megabytes=FLOOD // (1024 * 1024))

CUT_LINE = "x" * LINE_LIMIT + f" [{FLOOD - LINE_LIMIT} bytes cut]"


def _peak_bytes(consume) -> tuple[list[str], int]:
    """What ``consume()`` returned, and the most memory Python held meanwhile."""
    tracemalloc.start()
    try:
        result = consume()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_local_replica_flooding_one_line_costs_the_supervisor_one_bounded_line(tmp_path):
    from hetflow.cluster.backends.local.keeper import exit_path
    from hetflow.cluster.backends.local.replicas import LocalReplicas
    from hetflow.cluster.layout import plan_cluster
    from hetflow.spec import parse_spec

    spec = parse_spec({})
    cluster = LocalReplicas(plan_cluster(spec, "flood-run"), spec, tmp_path)
    cluster.paths.logs.mkdir(parents=True)
    cluster.paths.replicas.mkdir(parents=True)
    log = cluster.log_path("worker-0")
    log.touch()
    # The replica's side, in a process of its own: it writes while the supervisor follows.
    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, str(log), str(exit_path(tmp_path, "worker-0"))])
    (cluster.paths.replicas / "worker-0.pid").write_text(str(flooder.pid))  # as its keeper's
    lines, peak = _peak_bytes(lambda: list(cluster.lines("worker-0", since=0.0)))
    assert flooder.wait(timeout=60) == 0
    assert lines == [CUT_LINE, "after the flood"]
    assert peak < 2 * 1024 * 1024, f"following the flood held {peak / 2**20:.0f} MiB"


def test_a_container_flooding_one_line_is_logged_as_one_bounded_line(tmp_path):
    """The docker, swarm and kubernetes backends read an engine's stream of chunks: here a real
    process's pipe, read as the engine hands it over."""
    from hetflow.cluster.containers import lines_to_file

    flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, "-"], stdout=subprocess.PIPE)
    stream = iter(lambda: flooder.stdout.read1(64 * 1024), b"")
    log = tmp_path / "worker-0.log"
    lines, peak = _peak_bytes(lambda: list(lines_to_file(cut_lines(stream), log)))
    assert flooder.wait(timeout=60) == 0
    assert lines == [CUT_LINE, "after the flood"]
    assert log.read_text() == f"{CUT_LINE}\nafter the flood\n"
    assert peak < 2 * 1024 * 1024, f"following the flood held {peak / 2**20:.0f} MiB"
