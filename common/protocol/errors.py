"""Failures a stage reports for one request, with the HTTP status the router answers with.

Any other exception raised while a request is processed is an engine fault
(500); these two say something more precise about whose fault it is.
"""

from __future__ import annotations

import time


class RequestError(ValueError):
    """The request itself is wrong (answered with HTTP 400), not the engine."""

    status = 400


class Forbidden(RequestError):
    """The engine was not started to allow this (e.g. reading weights without --weight-root): HTTP 403."""

    status = 403


class DeadlineExceeded(RuntimeError):
    """The request's deadline passed; the router has answered it with 504 already."""

    status = 504


class Cancelled(RuntimeError):
    """The request was cancelled (its client went away, or ``/abort_request``): HTTP 499 ``cancelled``."""

    status = 499
    error_type = "cancelled"


class TransferFailed(RuntimeError):
    """A weight transfer from the trainer broke off or timed out; nothing was applied: HTTP 504."""

    status = 504


class Sleeping(RuntimeError):
    """The worker's weights are released (``/release_memory_occupation``): HTTP 503 ``sleeping``."""

    status = 503
    error_type = "sleeping"


class WeightsMissing(RuntimeError):
    """A resume found weights that were dropped and never given back: HTTP 409 ``weights_missing``."""

    status = 409
    error_type = "weights_missing"


def check_deadline(params) -> None:
    """Raise :class:`DeadlineExceeded` once ``params.deadline`` (seconds since the epoch) has passed."""
    if params.deadline is not None and time.time() > params.deadline:
        raise DeadlineExceeded("request deadline passed")
