"""Admission: refuse new work beyond a bound (429) or once shutdown began (503), instead of queueing."""

from __future__ import annotations

from router.core.errors import EngineError


def shutting_down(request_id: str = "") -> EngineError:
    return EngineError(503, "shutting_down", "engine is shutting down", "router", request_id)


class Admission:
    def __init__(self, max_pending: int):
        self.max_pending = max_pending
        self.draining = False

    def start_draining(self) -> None:
        """From the shutdown signal on, new requests get 503 while those in flight finish."""
        self.draining = True

    def check(self, in_flight: int, count: int) -> None:
        """Admit ``count`` more requests next to ``in_flight`` ones, or raise the refusal."""
        if self.draining:
            raise shutting_down()
        if in_flight + count > self.max_pending:
            raise EngineError(429, "overloaded", f"{in_flight} requests in flight (limit {self.max_pending})",
                              "router", "", headers={"Retry-After": "1"})
