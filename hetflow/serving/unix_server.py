"""An HTTP server on a Unix socket, for the endpoint's own answers behind HAProxy (the edge bundle,
the per-version metrics): only HAProxy, running as this user, connects (the socket is mode 0600)."""

from __future__ import annotations

import http.server
import os
import socket
import socketserver


class UnixHTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    address_family = socket.AF_UNIX
    daemon_threads = True  # an idle keep-alive connection does not hold shutdown()

    def __init__(self, path: str, handler: type[http.server.BaseHTTPRequestHandler]):
        super().__init__(path, handler)
        os.chmod(path, 0o600)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # HTTPServer's would look up a host name
        self.server_name, self.server_port = "localhost", 0
