"""The errors of the SGLang client (`sglang.py`, `sglang_weights.py`)."""

from __future__ import annotations


class SGLangError(RuntimeError):
    """A request that failed for good; the message names the server, the endpoint and the request."""

    def __init__(self, message: str, server: str = "", status: int | None = None):
        super().__init__(message)
        self.server, self.status = server, status


class BadRequestError(SGLangError):
    """HTTP 400: the server refused the request (the message is the server's)."""


class UnauthorizedError(SGLangError):
    """HTTP 401: missing or wrong API key."""


class EngineDiedError(SGLangError):
    """The server's process has exited (a local engine child): the message gives its exit code."""
