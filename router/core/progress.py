"""Where one request is: the requests in flight by the id their client knows, and how far each has come.

A client that names its request (``/generate``, ``/rollout/generate``, ``/v1/images/generations``: its
``X-Request-Id``, router/api/request_ids.py) can poll its progress while it waits for the answer (``disagg
generate`` draws its progress bar from it). The video jobs' ``progress`` is read by the same function, so the two
never disagree.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from common.protocol.messages import ROLES
from router.core.errors import EngineError
from router.link.attempts import attempt_id
from router.link.join import Pending, PendingTable

ENCODE_DONE, DENOISE_SPAN = 5, 85  # progress: 5 once encoded, up to 90 over the denoising steps
DENOISE, DECODE = ROLES.index("denoise"), ROLES.index("decode")


def state_of(p: Pending) -> dict:
    """The stage a request is in, its denoising step of how many (null until the denoise worker reports), and
    0-100 overall; never 100 while in flight."""
    steps = p.steps
    if p.done_stage >= DENOISE:
        return {"stage": "decode", "step": steps or 0, "steps": steps, "progress": ENCODE_DONE + DENOISE_SPAN}
    if p.done_stage < 0:
        return {"stage": "encode", "step": 0, "steps": steps, "progress": 0}
    percent = ENCODE_DONE + DENOISE_SPAN * p.step // steps if steps else ENCODE_DONE
    return {"stage": "denoise", "step": p.step, "steps": steps, "progress": percent}


class InFlight:
    """The requests in flight by the id their client knows, not by a run's wire id (router/link/attempts.py)."""

    def __init__(self, pending: PendingTable, max_attempts: int):
        self.pending, self.max_attempts = pending, max_attempts
        self._wire: set[str] = set()  # every wire id a claimed request may run under
        self._claimed: set[str] = set()

    def _wire_ids(self, request_id: str) -> list[str]:
        return [attempt_id(request_id, k) for k in range(1, self.max_attempts + 1)]

    @contextmanager
    def claim(self, request_id: str) -> Iterator[None]:
        """Hold ``request_id`` while its request runs. 409 when it is in flight already, or when either id is a
        run of the other (``a`` runs again as ``a.2``): two requests must never share a wire id."""
        wire = self._wire_ids(request_id)
        if any(w in self._wire or self.pending.get(w) is not None for w in wire):
            raise EngineError(409, "request_id_in_use", f"a request with id {request_id!r} (or one whose retries "
                              "would use its id) is in flight", "router", "")
        self._claimed.add(request_id)
        self._wire.update(wire)
        try:
            yield
        finally:
            self._claimed.discard(request_id)
            self._wire.difference_update(wire)

    def state(self, request_id: str) -> dict | None:
        """Its latest run's :func:`state_of`; a claimed request with no run yet (waiting for a worker) is at the
        start. None when it is not in flight."""
        run = self.pending.latest(request_id)
        if run is not None:
            return state_of(run[1])
        if request_id in self._claimed:
            return {"stage": "encode", "step": 0, "steps": None, "progress": 0}
        return None

    def percent(self, request_id: str) -> int | None:
        state = self.state(request_id)
        return None if state is None else state["progress"]
