"""The one kind of failure a request is answered with: a status and a one-line message."""


class RequestError(Exception):
    """A request this server answers with ``status`` and the one-line ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def bad_request(message: str) -> RequestError:
    return RequestError(400, message)
