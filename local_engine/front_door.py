"""A local engine's HTTP front door: the launched router's own app (router/api/app.py) over the local engine's
core, served by uvicorn on the core's event loop, in this process.

Every route a launched engine answers (the page, the OpenAI and peer APIs, PNG and MP4, keys, /metrics) answers
here the same way, with the workers' stages on threads instead of processes: for a notebook that wants the page,
and for tests whose subject is an HTTP answer rather than the process boundary.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from common.runtime.http_sockets import bind_http
from router.api.app import create_app
from router.core.engine import Engine


class FrontDoor:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, host: str, port: int,
                 api_key: str | None, admin_key: str | None):
        """Bind ``host:port`` (0: a free port) and serve; the engine is already started, so the app's own
        start / stop (its lifespan) stays off: the local engine owns them."""
        sockets = bind_http(host, port)
        self.port = sockets[0].getsockname()[1]
        self.url = f"http://{_url_host(sockets[0])}:{self.port}"
        app = create_app(engine, api_key=api_key, admin_key=admin_key)
        # Signals are the caller's: uvicorn installs no handler off the main thread, and this loop runs on its own.
        self._server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        self._serving = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=sockets), loop)
        asyncio.run_coroutine_threadsafe(self._started(), loop).result()

    async def _started(self) -> None:
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # the server's own error
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Stop accepting and let the requests in flight answer (uvicorn's graceful shutdown)."""
        self._server.should_exit = True
        self._serving.result()


def _url_host(sock: socket.socket) -> str:
    host = sock.getsockname()[0]
    return f"[{host}]" if sock.family == socket.AF_INET6 else host
