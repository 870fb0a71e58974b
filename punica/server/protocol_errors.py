"""ProtocolError: a request the server cannot serve, as OpenAI's error JSON names it."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A request the server understands but cannot serve; becomes an OpenAI error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code


def unsupported(field: str, what: str = "is not supported") -> ProtocolError:
    return ProtocolError(f"{field} {what}", param=field)
