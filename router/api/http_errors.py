"""Every HTTP error in one shape: ``{"error": {"type", "message", "request_id", "stage"[, "field"]}}``.

That includes what FastAPI/Starlette would otherwise answer in their own
``{"detail": ...}`` shape: unknown paths (404 ``not_found``), wrong methods
(405 ``method_not_allowed``, with ``Allow``) and parameter validation (400), and
any exception nothing else answers: a 500 ``internal_error`` with the request's
id, its traceback logged once (:class:`GuardRequests`).
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

from router.api.bodies import BodyTooLarge
from router.core.errors import EngineError
from router.api.values import raw_text_problem

log = logging.getLogger("disagg.router")
REQUEST_ID_HEADER = b"x-request-id"

class ErrorDetail(BaseModel):
    type: str = Field(description="what went wrong, e.g. invalid_request, overloaded, worker_lost, timeout")
    message: str
    request_id: str | None
    stage: str = Field(description="where: router, encoder, denoise or decode")
    field: str | None = Field(default=None, description="the offending request field (400)")


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def error_response(status: int, type_: str, message: str, stage: str = "router", request_id=None, field=None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    err = {"type": type_, "message": message, "request_id": request_id, "stage": stage}
    if field is not None:
        err["field"] = field
    return JSONResponse({"error": err}, status_code=status, headers=headers)


def first_error(errors: list[dict], skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """(field, message) of the first pydantic error; ``skip``: location prefixes such as "query"."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    while loc and loc[0] in skip:
        loc = loc[1:]
    field = ".".join(loc) or "body"
    return field, f"{field}: {first.get('msg')}"


async def engine_error(request: Request, e: EngineError) -> JSONResponse:
    """The router's one exception (a :class:`FieldError` too: 400 naming its field)."""
    return error_response(e.status, e.type, e.message, e.stage, e.request_id or None, field=e.field,
                          headers=e.headers)


async def body_too_large(request: Request, e: BodyTooLarge) -> JSONResponse:
    return error_response(413, "body_too_large", str(e), field="body")


async def invalid_body(request: Request, e: ValidationError) -> JSONResponse:
    field, message = first_error(e.errors())
    return error_response(400, "invalid_request", message, field=field)


async def invalid_parameter(request: Request, e: RequestValidationError) -> JSONResponse:
    field, message = first_error(list(e.errors()), skip=("query", "path", "header", "cookie", "body"))
    return error_response(400, "invalid_request", message, field=field)


def _http_message(request: Request, e: StarletteHTTPException) -> str:
    path = request.url.path
    if e.status_code == 404:
        return f"no endpoint at {path}"
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return f"{request.method} is not allowed on {path}" + (f"; use {allowed}" if allowed else "")
    return str(e.detail)


def _http_type(status: int) -> str:
    """not_found, method_not_allowed, ...: the status phrase in snake case."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "http_error"


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (no route, wrong method), keeping their headers (``Allow``)."""
    return error_response(e.status_code, _http_type(e.status_code), _http_message(request, e),
                          headers=dict(e.headers or {}))


def internal_error(request_id: str | None) -> JSONResponse:
    return error_response(500, "internal_error", "the router failed on this request; the engine's log has the "
                          "traceback under this request id", request_id=request_id)


async def unexpected(request: Request, e: Exception) -> JSONResponse:
    """An exception raised outside :class:`GuardRequests` (in a middleware): the server logs it once."""
    return internal_error(request.headers.get("x-request-id"))


class GuardRequests:
    """ASGI middleware, innermost (inside the API keys, the metrics and the body drain): a query or path that
    is not UTF-8 is a 400 naming it before any route runs (router/api/values.py); a request without an
    ``X-Request-Id`` is given a random one here, so that every answer, a 500 included, can name it; an
    exception no handler answered is logged once with its traceback and becomes a 500 ``internal_error``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = raw_text_problem(scope)
        if problem is not None:
            await error_response(400, "invalid_request", str(problem), field=problem.field)(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if REQUEST_ID_HEADER not in headers:
            headers[REQUEST_ID_HEADER] = uuid.uuid4().hex.encode()
            # In place: the middlewares outside read what routing adds to this scope (the metrics' route).
            scope["headers"] = [*scope["headers"], (REQUEST_ID_HEADER, headers[REQUEST_ID_HEADER])]
        rid = headers[REQUEST_ID_HEADER].decode("latin-1")
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:
            log.exception("%s %s failed (request %s)", scope["method"], scope["path"], rid[:80])
            if not started:  # else the client sees the answer cut short: nothing more can be said
                await internal_error(rid[:80])(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.user_middleware.append(Middleware(GuardRequests))  # innermost, whatever was added before
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(EngineError, engine_error)
    app.add_exception_handler(BodyTooLarge, body_too_large)
    app.add_exception_handler(ValidationError, invalid_body)
    app.add_exception_handler(RequestValidationError, invalid_parameter)
    app.add_exception_handler(StarletteHTTPException, http_error)
