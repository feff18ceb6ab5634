"""Pausing the engine's admission (vLLM's ``/pause`` and ``/resume``, as vLLM-Omni's RL API calls them).

While the engine is paused a new generation waits before admission (:meth:`Engine.run` and :meth:`Engine.run_job`
await :meth:`PauseGate.wait_open`) until it resumes; nothing in flight is frozen (a step cannot be stopped half
way): a pause either waits for the generations in flight to end (``wait``) or cancels them (``abort``), and is
complete (``barrier_complete``) once none is left. Nothing here speaks HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from router.core.errors import EngineError

MODES = ("abort", "wait", "keep")  # keep: as wait (a generation in flight cannot be frozen mid-step)
POLL_S = 0.02


class PauseGate:
    """Whether new generations are held back, and whether the pause's barrier (nothing in flight) was reached."""

    def __init__(self):
        self.paused = False
        self.barrier_complete = False
        self.waiting = 0  # generations held back now
        self._open: asyncio.Event | None = None  # made in the running loop, on first use
        self._epoch = 0  # each pause and resume: a pause that waits stops when another one follows it

    def _event(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            if not self.paused:
                self._open.set()
        return self._open

    async def wait_open(self) -> None:
        """Return at once unless paused; else once resumed."""
        while self.paused:
            self.waiting += 1
            try:
                await self._event().wait()
            finally:
                self.waiting -= 1

    async def pause(self, mode: str, abort_all: Callable[[], object], busy: Callable[[], int],
                    timeout_s: float) -> None:
        """Hold back new generations; ``abort``: cancel those in flight (``abort_all``); then wait until none is
        (``busy()`` is 0), at most ``timeout_s`` (504, the pause stays on). A pause whose barrier is complete
        already does nothing."""
        if mode not in MODES:
            raise EngineError(400, "invalid_request", f"mode: must be one of {', '.join(MODES)}, got {mode!r}",
                              "router", "", field="mode")
        if self.paused and self.barrier_complete:
            return
        self.paused, self.barrier_complete = True, False
        self._event().clear()
        self._epoch += 1
        epoch = self._epoch
        if mode == "abort":
            abort_all()
        deadline = time.monotonic() + timeout_s
        while busy() and self._epoch == epoch:
            if time.monotonic() > deadline:
                raise EngineError(504, "timeout", f"paused, but {busy()} generation(s) are still in flight after "
                                  f"{timeout_s:g} s (POST /resume, or pause again with mode=abort)", "router", "")
            await asyncio.sleep(POLL_S)
        if self._epoch == epoch and self.paused:
            self.barrier_complete = True

    def resume(self) -> None:
        self.paused = self.barrier_complete = False
        self._epoch += 1
        self._event().set()

    def status(self) -> dict:
        return {"is_paused": self.paused, "barrier_complete": self.barrier_complete}
