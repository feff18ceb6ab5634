"""The one exception every router piece raises for a failed request."""

from __future__ import annotations


class EngineError(Exception):
    """A request failed; carries what the HTTP error body reports (see :mod:`router.api.http_errors`)."""

    def __init__(self, status: int, type_: str, message: str, stage: str, request_id: str,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.stage, self.request_id = status, type_, message, stage, request_id
        self.headers = headers or {}
