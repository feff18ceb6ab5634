"""Running a request again when a worker dies holding it, so that its client gets the answer anyway.

A generation is a pure function of the request, its seed, the weight version and the adapter version (all
noise comes from the seed), so a request that a dying worker held (503 ``worker_lost``) can run again from
the start on ready instances and give exactly what an undisturbed run gives. Each attempt has its own wire
id (``<id>.<attempt>``), so a late answer from an earlier attempt is dropped, never delivered twice.

- At most ``--max-attempts`` attempts in all (``1``: a lost worker's requests fail, as before), within the
  request's deadline, which stays the one set at admission.
- A rollout whose weights or adapter changed between attempts is answered 409 ``weights_changed``: its
  log-probs must belong to the version it was asked under. Serving runs again on the current weights, and
  its answer says which (``weight_version``).
- A cancelled request (router/link/cancel.py) never runs again.
- A request that takes its worker down on every attempt (a poison request) fails with the last error once
  its attempts are used, so it cannot keep the engine in a crash loop; the supervisor restarts the worker
  (with backoff when it dies quickly) and it serves the others. Requests that were in the same process
  when it crashed lose an attempt too.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from router.core.errors import EngineError

log = logging.getLogger("disagg.router")

T = TypeVar("T")
Versions = Callable[[], tuple]  # what a rollout must not see change between attempts (weights, adapter)
RETRIED = "worker_lost"


def attempt_id(request_id: str, attempt: int) -> str:
    return request_id if attempt == 1 else f"{request_id}.{attempt}"


async def with_attempts(run: Callable[[int], Awaitable[T]], request_id: str, max_attempts: int,
                        versions: Versions | None = None, rollout: bool = False,
                        cancelled: Callable[[], bool] = lambda: False) -> tuple[T, int]:
    """``run(attempt)`` until it succeeds or fails other than by a lost worker (or ``cancelled()``); (its
    result, attempts)."""
    started = versions() if versions is not None else None
    attempt = 1
    while True:
        try:
            return await run(attempt), attempt
        except EngineError as e:
            if e.type != RETRIED or attempt >= max_attempts or cancelled():
                if attempt > 1:  # the client's id, not the run's wire id
                    e.message = f"{e.message} (attempt {attempt} of {max_attempts})"
                    e.headers, e.request_id = {**e.headers, "X-Attempts": str(attempt)}, request_id
                raise
            if rollout and versions is not None and (now := versions()) != started:
                raise EngineError(409, "weights_changed",
                                  f"{e.message}; the weights or adapter changed since this rollout was admitted "
                                  f"(versions {started} -> {now}), so it is not run again on other weights",
                                  e.stage, request_id, {"X-Attempts": str(attempt)}) from None
            attempt += 1
            log.warning("request %s: %s; running it again (attempt %d of %d)", request_id, e.message, attempt,
                        max_attempts)
