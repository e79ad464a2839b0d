"""A bound for what two training processes exchange per step on this machine: the same bytes moved
by the simplest means, two Python processes over a loopback TCP socket, each pinned to a core of its
own as mwms_2's workers are. Two patterns:

``all_reduce`` (mwms_2's step, the default): both sum their buffers.

A ring all-reduce of n workers over a buffer of B bytes sends 2·(n−1)/n·B bytes from each worker
(reduce-scatter, then all-gather). For n = 2 that is B each way, in two halves: each process sends
the half the other one keeps and adds the half it receives into its own (reduce-scatter), then
sends its summed half and receives the other (all-gather). Sending and receiving run at once (a
thread sends), as in a ring. The buffer is float32, as the gradients are; the time per all-reduce
is the median over ``--repeats`` after a warm-up, both processes starting each one together (the
exchange itself keeps them in step).

``round_trip`` (a parameter_server step, the ps and one worker): process 0, the ps, sends its
buffer; process 1, the worker, receives it all and sends as many bytes back, which process 0 adds
into its buffer. Each sends the buffer once, one after the other.

    python bench/socket_bound.py --bytes 4400000 [--pattern round_trip]

Prints one JSON line: bytes, the pattern, bytes sent by each process per exchange, seconds per
exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

WARMUP = 3


def receive_into(connection: socket.socket, view: memoryview) -> None:
    while view:
        got = connection.recv_into(view)
        if not got:
            raise ConnectionError("the peer closed the connection mid-exchange")
        view = view[got:]


def exchange(connection: socket.socket, outgoing: np.ndarray, incoming: np.ndarray) -> None:
    """Send ``outgoing`` while receiving ``incoming``'s bytes."""
    sender = threading.Thread(target=connection.sendall, args=(memoryview(outgoing).cast("B"),))
    sender.start()
    receive_into(connection, memoryview(incoming).cast("B"))
    sender.join()


def all_reduce(connection: socket.socket, rank: int, buffer: np.ndarray, scratch: np.ndarray) -> int:
    """Sum ``buffer`` with the peer's, in place (ring all-reduce of two); return the bytes sent."""
    halves = np.array_split(buffer, 2)
    mine, theirs = halves[rank], halves[1 - rank]
    exchange(connection, theirs, scratch[: mine.size])  # reduce-scatter
    mine += scratch[: mine.size]
    exchange(connection, mine, theirs)  # all-gather
    return theirs.nbytes + mine.nbytes


def round_trip(connection: socket.socket, rank: int, buffer: np.ndarray, scratch: np.ndarray) -> int:
    """Rank 0's ``buffer`` to rank 1 and an update of its size back, added into it; return the
    bytes sent."""
    if rank == 0:
        connection.sendall(memoryview(buffer).cast("B"))
        receive_into(connection, memoryview(scratch).cast("B"))
        buffer += scratch
    else:
        receive_into(connection, memoryview(scratch).cast("B"))
        connection.sendall(memoryview(scratch).cast("B"))
    return buffer.nbytes


PATTERNS = {"all_reduce": all_reduce, "round_trip": round_trip}


def pin(rank: int) -> None:
    # The workers' assignment (hetflow/cluster/backends/local/replicas.py): the allowed cores in order, round robin.
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def run(connection: socket.socket, rank: int, size: int, repeats: int, pattern: str) -> tuple[list[float], int]:
    """Seconds of each timed exchange of ``size`` bytes in ``pattern``, and the bytes each one sent."""
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = np.ones(size // 4, np.float32)
    scratch = np.empty(buffer.size, np.float32)
    seconds = []
    for i in range(WARMUP + repeats):
        exchange(connection, np.zeros(1, np.float32), np.empty(1, np.float32))  # start together
        started = time.perf_counter()
        sent = PATTERNS[pattern](connection, rank, buffer, scratch)
        if i >= WARMUP:
            seconds.append(time.perf_counter() - started)
    return seconds, sent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, required=True, help="bytes all-reduced (a multiple of 4: float32)")
    parser.add_argument("--pattern", choices=PATTERNS, default="all_reduce")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--peer", type=int, help=argparse.SUPPRESS)  # the second process: rank 0's port
    args = parser.parse_args()
    if args.bytes <= 0 or args.bytes % 4:
        parser.error(f"--bytes={args.bytes} is invalid: expected a positive multiple of 4")
    if args.peer is not None:
        pin(1)
        with socket.create_connection(("127.0.0.1", args.peer)) as connection:
            run(connection, 1, args.bytes, args.repeats, args.pattern)
        return 0
    pin(0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        peer = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], f"--peer={server.getsockname()[1]}"])
        try:
            connection, _ = server.accept()
            with connection:
                seconds, sent = run(connection, 0, args.bytes, args.repeats, args.pattern)
        finally:
            if peer.wait(timeout=60) != 0:
                raise RuntimeError(f"the peer process exited with {peer.returncode}")
    result = {
        "bytes": args.bytes,
        "pattern": args.pattern,
        "bytes_sent_per_process": sent,
        "repeats": args.repeats,
        "seconds": statistics.median(seconds),
        "seconds_min": min(seconds),
        "seconds_max": max(seconds),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
