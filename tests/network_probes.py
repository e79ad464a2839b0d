"""What the network tests run on either side of a replica's port: ``SERVE`` stands for a replica's
gRPC server (TF's servers listen on 0.0.0.0 and run graph ops for whoever connects) and answers
``ANSWER``; ``CONNECT`` (argv: host, port) prints what it read, or "refused: ..." on an OSError.

A test asserts on the answer, not on the connection: a machine may intercept outgoing TCP (this
one's proxy accepts a connection to any address and answers it itself)."""

from __future__ import annotations

from hetflow.cluster.layout import SERVICE_PORT

ANSWER = "graph ops run here"

SERVE = (
    "import socket\n"
    f"server = socket.create_server(('0.0.0.0', {SERVICE_PORT}))\n"
    "print('listening', flush=True)\n"
    "while True:\n"
    "    peer, _ = server.accept()\n"
    f"    peer.sendall({ANSWER.encode()!r})\n"
    "    peer.close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).recv(64).decode())\n"
    "except OSError as error:\n"
    "    print('refused:', error)\n"
)
