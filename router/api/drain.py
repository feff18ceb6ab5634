"""Early answers that every HTTP client can read: what the app left of the request body is read first.

Clients such as Python's ``urllib`` send their whole body before they read anything. When the router
answers before it has read the body (413 for a body over the limit, 401 without the key, 404, 429, 503) and
the connection closes while body bytes are still arriving, the client's next write fails (broken pipe,
connection reset) and it never sees the answer. So before a response starts, :class:`ReadBodyFirst` reads
and drops what is left of the body, up to ``DRAIN_BYTES`` and ``DRAIN_S``; past either, the answer goes out
with ``Connection: close`` (``curl`` still reads it; a client that writes everything first may not).
A client that asked ``Expect: 100-continue`` and has sent nothing yet is answered at once: it never sends
the body.
"""

from __future__ import annotations

import asyncio

DRAIN_BYTES = 256 << 20
DRAIN_S = 30.0


class ReadBodyFirst:
    """ASGI middleware; put it outermost so that every early answer goes through it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"done": False, "started": False}
        expects_continue = (b"expect", b"100-continue") in [(k.lower(), v.lower()) for k, v in scope["headers"]]

        async def tracked_receive():
            msg = await receive()
            state["started"] = True
            if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
                state["done"] = True
            return msg

        async def send_after_body(msg):
            if msg["type"] == "http.response.start" and not state["done"]:
                if expects_continue and not state["started"]:
                    drained = False  # the client waits for our word before it sends the body: none comes
                else:
                    drained = await _drain(receive, state)
                if not drained:
                    msg = {**msg, "headers": [*msg.get("headers", []), (b"connection", b"close")]}
            await send(msg)

        await self.app(scope, tracked_receive, send_after_body)


async def _drain(receive, state: dict) -> bool:
    """Read the rest of the body and drop it; False when it is too long (bytes or time) to wait for."""
    loop = asyncio.get_running_loop()
    deadline, read = loop.time() + DRAIN_S, 0
    while not state["done"]:
        try:
            msg = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return False
        if msg["type"] == "http.disconnect" or not msg.get("more_body", False):
            state["done"] = True
        read += len(msg.get("body", b""))
        if read > DRAIN_BYTES:
            return False
    return True
