"""Cancelling requests: a client that goes away, ``POST /abort_request`` (router/api/cancel_api.py), ``DELETE
/v1/videos/{id}`` (router/core/jobs.py).

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

from router.core.errors import EngineError

log = logging.getLogger("disagg.router")
T = TypeVar("T")
PARTIAL_WAIT_S = 10.0  # how long an aborted rollout waits for its partial answer before it is plainly cancelled
DISCONNECTED, ABORTED, JOB_DELETED = "client_disconnected", "aborted", "job_deleted"  # the metric's reasons


@dataclass
class _Run:
    rid: str
    task: asyncio.Task
    partial: bool  # a rollout with return_partial: an abort asks for the steps done
    reason: str | None = None  # why it was cancelled, once it is


class Cancellations:
    """The generations in flight by request id, each cancellable; ``counted(reason)`` for each one cancelled."""

    def __init__(self, ask_partial: Callable[[str], bool], counted: Callable[[str], None]):
        self.ask_partial, self.counted = ask_partial, counted  # ask_partial: Dispatcher.cancel_partial
        self._runs: dict[str, _Run] = {}

    def running(self) -> int:
        """How many generations are in flight (each holds a cancellable task until it ends)."""
        return len(self._runs)

    def cancelled(self, rid: str) -> bool:
        """Whether the request was cancelled (a worker lost meanwhile must not make it run again)."""
        run = self._runs.get(rid)
        return run is not None and run.reason is not None

    async def run(self, rid: str, work: Awaitable[T], gone: Callable[[], Awaitable[None]] | None = None,
                  partial: bool = False) -> T:
        """``work`` (a request's submit) as a task :meth:`abort` can cancel, and that ends when ``gone()``
        returns (its client went away); a cancelled request raises 499 ``cancelled``."""
        task = asyncio.ensure_future(work)
        run = self._runs[rid] = _Run(rid, task, partial)
        watch = asyncio.ensure_future(gone()) if gone is not None else None
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

    def cancel(self, rid: str) -> list[str]:
        """Cancel request ``rid`` (``POST /abort_request``'s ``rid``); the ids cancelled. 404 when no such
        request is in flight."""
        if not self.abort(rid):
            raise EngineError(404, "not_found", f"no request {rid!r} is in flight (unknown, or answered already)",
                              "router", "", field="rid")
        return [rid]

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
