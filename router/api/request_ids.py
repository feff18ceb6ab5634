"""The ``X-Request-Id`` header that names a request (for ``GET /progress/{id}`` and ``POST /abort_request``)."""

from __future__ import annotations

import re
import uuid

from fastapi import Request

from router.core.errors import FieldError

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
REQUEST_ID_PARAMETER = {"name": REQUEST_ID_HEADER, "in": "header", "required": False,
                        "description": "the request's id (1-64 of A-Z a-z 0-9 _ . -), for GET /progress/{id}; "
                                       "default: a random one",
                        "schema": {"type": "string", "pattern": f"^{REQUEST_ID.pattern}$"}}
REQUEST_ID_PATH = {"parameters": [{"name": "request_id", "in": "path", "required": True,
                                   "description": "the id the request was sent with (X-Request-Id)",
                                   "schema": {"type": "string"}}]}


def request_id_of(request: Request) -> str:
    """The client's ``X-Request-Id``, else a random id; a malformed one is a 400 naming the header."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(value):
        raise FieldError(REQUEST_ID_HEADER, f"must be 1-64 characters of A-Z a-z 0-9 _ . -, got {value[:80]!r}")
    return value
