"""``POST /abort_request`` (as SGLang's), and watching for a client that goes away. The cancelling itself:
:class:`router.link.cancel.Cancellations`, through the engine."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from router.api.auth import ADMIN_SCOPE
from router.api.bodies import parse_body
from router.api.http_errors import error_response
from router.core.errors import FieldError

log = logging.getLogger("disagg.router")


class AbortBody(BaseModel):
    """``POST /abort_request``, as SGLang's."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"rid": "job-17"}]})

    rid: str | None = Field(default=None, min_length=1, max_length=64,
                            description="the request's id: the X-Request-Id it was sent with")
    abort_all: bool = Field(default=False, description="every request in flight (admin key)")


def gone_of(request: Request):
    """What :meth:`Cancellations.run` waits on: returns once ``request``'s client has gone away."""
    async def client_gone() -> None:
        # Its body was read already: only ``http.disconnect`` is left.
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # a server that repeats an empty body part must not make this spin
    return client_gone


async def abort_request(cancels, request: Request, max_body_bytes: int) -> JSONResponse:
    """``{"rid": ...}`` or ``{"abort_all": true}`` (the admin's), over ``cancels``' ``cancel`` / ``abort_all``
    (the engine's)."""
    body = AbortBody.model_validate(await parse_body(request, max_body_bytes))
    if body.abort_all:
        if not request.scope.get(ADMIN_SCOPE, True):  # set by router/api/auth.py
            return error_response(403, "forbidden", "abort_all needs the admin key")
        return JSONResponse({"aborted": cancels.abort_all()})
    if body.rid is None:
        raise FieldError("rid", "give the request's id (its X-Request-Id), or abort_all")
    return JSONResponse({"aborted": cancels.cancel(body.rid)})


async def client_gone_mid_body(request: Request, e: ClientDisconnect) -> JSONResponse:
    """A client that went away while sending its body: one log line (nobody reads the answer)."""
    log.info("%s %s: the client went away before its body was read", request.method, request.url.path)
    return error_response(499, "client_disconnected", "the client went away before its body was read")
