"""``python serving_relay.py SOCKET PORT -- COMMAND...``: run COMMAND (a model server listening on
127.0.0.1:PORT) and relay every connection made to the Unix socket SOCKET to it.

The served check's model server runs in a sandbox with a network namespace of its own
(``hetflow.sandbox``), which nothing outside can reach over TCP; the socket, in a directory shared
with the pipeline, is the one way in. Standard library only, run as a script: the sandbox carries
no hetflow on its path. Exits with COMMAND's exit code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

_CHUNK = 1 << 16


def _pipe(source: socket.socket, target: socket.socket) -> None:
    try:
        while chunk := source.recv(_CHUNK):
            target.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _relay(client: socket.socket, port: int) -> None:
    try:
        server = socket.create_connection(("127.0.0.1", port))
    except OSError:  # not listening yet: the client sees a closed connection and asks again
        client.close()
        return
    threading.Thread(target=_pipe, args=(server, client), daemon=True).start()
    _pipe(client, server)


def main(argv: list[str]) -> int:
    path, port, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: serving_relay.py SOCKET PORT -- COMMAND...")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    server = subprocess.Popen(command)

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            threading.Thread(target=_relay, args=(client, int(port)), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    code = server.wait()
    os.unlink(path)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
