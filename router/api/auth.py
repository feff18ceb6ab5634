"""API keys on the router: ``Authorization: Bearer <key>``.

* With an API key, every endpoint except ``GET /health`` and the web page's files
  (``GET /``, ``GET /docs``, ``GET /static/...``: no data in them, router/api/web.py) needs
  it; a missing or wrong key gets 401 with ``WWW-Authenticate: Bearer``.
* With an admin key, the admin endpoints (weight updates) need the admin key
  instead: the API key alone gets 403. Without an admin key they take the API
  key (if any). Whether a caller may act as the admin is left in the request's
  scope (``disagg.admin``) for an endpoint that decides by its body
  (``POST /abort_request``'s ``abort_all``).

Keys are compared in constant time (over their SHA-256 digests, so not even
the length leaks) and never logged. The launcher reads them from
``DISAGG_API_KEY`` / ``DISAGG_ADMIN_KEY`` (or ``--api-key`` / ``--admin-key``,
which other local users can see in ``ps``) and hands them to the app directly:
they are never written into the engine config file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import MutableMapping

log = logging.getLogger("disagg.router.api.auth")

API_KEY_ENV = "DISAGG_API_KEY"
ADMIN_KEY_ENV = "DISAGG_ADMIN_KEY"
# Paths that change the engine (any method).
# SGLang diffusion's control routes (router/peers/sglang/routes.py), at the root and under its prefix; vLLM-Omni's
# check the admin scope themselves (router/peers/vllm_omni/routes.py).
SGLANG_ADMIN = ("/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
                "/update_weights_from_distributed", "/destroy_weights_update_group", "/release_memory_occupation",
                "/resume_memory_occupation")
ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                         "/weight_sync", "/update_weights_from_tensors", "/init_weights_group",
                         "/update_weights_from_distributed", "/destroy_weights_group",
                         "/release_memory_occupation", "/resume_memory_occupation", "/sleep", "/wake_up",
                         "/pin_reference", *SGLANG_ADMIN, *("/sglang" + p for p in SGLANG_ADMIN)})
# (method, path) pairs anyone may call: health, and the web page and API docs (static, no data: what they show
# comes from endpoints that need the key, /openapi.json included).
OPEN_ENDPOINTS = frozenset({("GET", "/health"), ("GET", "/"), ("GET", "/docs")})
OPEN_PREFIX = ("GET", "/static/")  # the page's files (router/api/static/), served by StaticFiles only
ADMIN_SCOPE = "disagg.admin"  # in a request's scope: whether its caller may act as the admin


def check_key(key: str | None, what: str) -> str | None:
    """``None`` for no key; otherwise the key, if it can travel in an HTTP header."""
    if key is None or key == "":
        return None
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{what} must be printable ASCII without spaces")
    if len(key) < 16:
        log.warning("%s is shorter than 16 characters; use a long random key (e.g. `openssl rand -hex 32`)", what)
    return key


def keys_from_environment(api_key: str | None, admin_key: str | None,
                          environ: MutableMapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """Keys given by flag win over the environment; the variables are removed from ``environ``
    either way, so that child processes (the workers, which need no key) do not inherit them."""
    environ = os.environ if environ is None else environ
    env_api, env_admin = environ.pop(API_KEY_ENV, None), environ.pop(ADMIN_KEY_ENV, None)
    api = check_key(api_key if api_key else env_api, "the API key")
    admin = check_key(admin_key if admin_key else env_admin, "the admin key")
    if api is not None and admin is not None and hmac.compare_digest(api.encode(), admin.encode()):
        raise ValueError("the admin key must differ from the API key")
    return api, admin


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _matches(token: bytes | None, expected: bytes | None) -> bool:
    if token is None or expected is None:
        return False
    return hmac.compare_digest(_digest(token), expected)


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the one ``Authorization: Bearer <token>`` header, else ``None``."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return None
    return token


class ApiKeyMiddleware:
    """ASGI middleware that enforces the API and admin keys before any route runs."""

    def __init__(self, app, api_key: str | None = None, admin_key: str | None = None):
        self.app = app
        self._api = _digest(api_key.encode()) if api_key else None
        self._admin = _digest(admin_key.encode()) if admin_key else None

    @property
    def enabled(self) -> bool:
        return self._api is not None or self._admin is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.enabled:
            scope[ADMIN_SCOPE] = True
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", "GET"), scope.get("path", "")
        if (method, path) in OPEN_ENDPOINTS or (method == OPEN_PREFIX[0] and path.startswith(OPEN_PREFIX[1])):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers", []))
        if path in ADMIN_PATHS and self._admin is not None:
            if _matches(token, self._admin):
                await self.app(scope, receive, send)
            elif _matches(token, self._api):
                await _deny(send, 403, "forbidden", "this endpoint needs the admin key")
            else:
                await _deny(send, 401, "unauthorized", "missing or invalid admin key (Authorization: Bearer <key>)")
            return
        if self._api is None or _matches(token, self._api) or _matches(token, self._admin):
            scope[ADMIN_SCOPE] = self._admin is None or _matches(token, self._admin)
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.info("401 for %s %s from %s", method, path, client[0])
        await _deny(send, 401, "unauthorized", "missing or invalid API key (Authorization: Bearer <key>)")


async def _deny(send, status: int, type_: str, message: str) -> None:
    body = json.dumps({"error": {"type": type_, "message": message, "request_id": None, "stage": "router"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
