"""The one exception every router piece raises for a failed request."""

from __future__ import annotations


class EngineError(Exception):
    """A request failed; carries what the HTTP error body reports (see :mod:`router.api.http_errors`):
    ``field`` names the offending request field, when one did."""

    def __init__(self, status: int, type_: str, message: str, stage: str, request_id: str,
                 headers: dict[str, str] | None = None, field: str | None = None):
        super().__init__(message)
        self.status, self.type, self.message, self.stage, self.request_id = status, type_, message, stage, request_id
        self.headers, self.field = headers or {}, field


class FieldError(EngineError, ValueError):
    """A request field is invalid: 400 ``invalid_request`` naming it. A ValueError too, so that pydantic
    validators may raise it."""

    def __init__(self, field: str, message: str):
        super().__init__(400, "invalid_request", f"{field}: {message}", "router", "", field=field)
