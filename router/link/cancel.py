"""Cancelling requests: a client that goes away, ``POST /abort_request``, ``DELETE /v1/videos/{id}`` (router/openai/jobs.py).

A generation in flight runs as its own task, which :class:`Cancellations` holds by the request's id (its
``X-Request-Id``). Cancelling it cancels that task: the dispatcher then sends the workers a ``Cancel`` for the
run (router/link/dispatcher.py), which each stage that holds it drops at once (the denoise worker at the next step
boundary), the id is free again at once, and the request is answered 499 ``cancelled``. A rollout that asked
for ``return_partial`` is instead asked for what it has: the denoise worker answers with the steps it took.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from router.api.auth import ADMIN_SCOPE
from router.api.bodies import parse_body
from router.core.errors import EngineError
from router.api.http_errors import error_response
from router.api.schemas import FieldError

log = logging.getLogger("disagg.router")
T = TypeVar("T")
PARTIAL_WAIT_S = 10.0  # how long an aborted rollout waits for its partial answer before it is plainly cancelled
DISCONNECTED, ABORTED, JOB_DELETED = "client_disconnected", "aborted", "job_deleted"  # the metric's reasons


class AbortBody(BaseModel):
    """``POST /abort_request``, as SGLang's."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [{"rid": "job-17"}]})

    rid: str | None = Field(default=None, min_length=1, max_length=64,
                            description="the request's id: the X-Request-Id it was sent with")
    abort_all: bool = Field(default=False, description="every request in flight (admin key)")


@dataclass
class _Run:
    rid: str
    task: asyncio.Task
    partial: bool  # a rollout with return_partial: an abort asks for the steps done
    reason: str | None = None  # why it was cancelled, once it is


async def client_gone(request: Request) -> None:
    """Returns once the HTTP client has gone away (its body was read already: only ``http.disconnect`` is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # a server that repeats an empty body part must not make this spin


class Cancellations:
    """The generations in flight by request id, each cancellable; ``counted(reason)`` for each one cancelled."""

    def __init__(self, ask_partial: Callable[[str], bool], counted: Callable[[str], None]):
        self.ask_partial, self.counted = ask_partial, counted  # ask_partial: Dispatcher.cancel_partial
        self._runs: dict[str, _Run] = {}

    def cancelled(self, rid: str) -> bool:
        """Whether the request was cancelled (a worker lost meanwhile must not make it run again)."""
        run = self._runs.get(rid)
        return run is not None and run.reason is not None

    async def run(self, rid: str, work: Awaitable[T], request: Request | None = None, partial: bool = False) -> T:
        """``work`` (a request's submit) as a task :meth:`abort` can cancel, and that ends when ``request``'s
        client goes away; a cancelled request raises 499 ``cancelled``."""
        task = asyncio.ensure_future(work)
        run = self._runs[rid] = _Run(rid, task, partial)
        watch = asyncio.ensure_future(client_gone(request)) if request is not None else None
        try:
            await asyncio.wait({task, watch} - {None}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client went away
                self._cancel(run, DISCONNECTED, partial=False)
            await asyncio.wait({task})
        except asyncio.CancelledError:  # the server stops (past its grace period), a job deleted: the work stops
            task.cancel()
            await asyncio.wait({task})
            raise
        finally:
            if watch is not None:
                watch.cancel()
                if watch.done() and not watch.cancelled():
                    watch.exception()  # a receive that failed: the client is gone as well; nothing to log
            if self._runs.get(rid) is run:
                del self._runs[rid]
        if run.reason is not None and (task.cancelled() or task.exception() is not None):
            raise EngineError(499, "cancelled", f"request {rid} was cancelled ({run.reason})", "router", rid)
        return task.result()

    def abort(self, rid: str, reason: str = ABORTED) -> bool:
        """Cancel request ``rid``; False when no such request is in flight."""
        run = self._runs.get(rid)
        if run is None or run.task.done():
            return False
        if run.reason is None:
            self._cancel(run, reason, partial=run.partial)
        return True

    def abort_all(self) -> list[str]:
        """Cancel every request in flight; the ids of those not cancelled before."""
        return [rid for rid, run in list(self._runs.items()) if run.reason is None and self.abort(rid)]

    def _cancel(self, run: _Run, reason: str, partial: bool) -> None:
        run.reason = reason
        self.counted(reason)
        log.info("request %s cancelled (%s)", run.rid, reason)
        if partial and self.ask_partial(run.rid):  # the denoise worker answers with the steps done, or 499
            loop = asyncio.get_running_loop()
            timer = loop.call_later(PARTIAL_WAIT_S, run.task.cancel)
            run.task.add_done_callback(lambda _: timer.cancel())
        else:
            run.task.cancel()

    async def endpoint(self, request: Request, max_body_bytes: int) -> JSONResponse:
        """``POST /abort_request``: ``{"rid": ...}`` or ``{"abort_all": true}`` (the admin's)."""
        body = AbortBody.model_validate(await parse_body(request, max_body_bytes))
        if body.abort_all:
            if not request.scope.get(ADMIN_SCOPE, True):  # set by router/api/auth.py
                return error_response(403, "forbidden", "abort_all needs the admin key")
            return JSONResponse({"aborted": self.abort_all()})
        if body.rid is None:
            raise FieldError("rid", "give the request's id (its X-Request-Id), or abort_all")
        if not self.abort(body.rid):
            return error_response(404, "not_found", f"no request {body.rid!r} is in flight (unknown, or answered "
                                  "already)", field="rid")
        return JSONResponse({"aborted": [body.rid]})


async def client_gone_mid_body(request: Request, e: ClientDisconnect) -> JSONResponse:
    """A client that went away while sending its body: one log line (nobody reads the answer)."""
    log.info("%s %s: the client went away before its body was read", request.method, request.url.path)
    return error_response(499, "client_disconnected", "the client went away before its body was read")
