"""The pinned KL reference (``kl_reference: "pinned"``) across every denoise worker: ``POST /pin_reference``.

A pin copies every expert's current weights on every denoise worker (denoise_worker/pinned.py). It counts only
when all of them answered: until then, and after a pin that failed on some worker (the workers may now hold
different copies), the router knows no pin and refuses a rollout that asks for it (a 400 naming
``kl_reference``). A denoise worker that restarted holds no copy, so its return forgets the pin as well: the
reference is never silently another model; POST /pin_reference again (the old copy cannot be rebuilt once the
weights moved on). A pin holds the weight updates' lock: the version it reports is the one copied.
"""

from __future__ import annotations

import time

from common.protocol.control import PinReference, PinReply
from common.protocol.messages import GenerationParams
from router.control.weights import WeightControl
from router.core.errors import FieldError


def asks_pinned(params: GenerationParams) -> bool:
    r = params.rollout
    return r is not None and r.return_kl and r.kl_reference == "pinned"


class PinControl:
    role = WeightControl.role

    def __init__(self, weights: WeightControl):
        self.weights = weights
        self.version: int | None = None  # the weight version every worker pinned; None: no pin

    async def pin(self) -> dict:
        versioned = self.weights.versioned
        async with versioned.lock:
            t0 = time.perf_counter()
            self.version = None  # a failure below may leave the workers with different copies
            replies: list[PinReply] = await versioned.send(PinReference)
            self.version = self.weights.version
        return {"weight_version": self.version, "experts": replies[0].experts,
                "seconds": time.perf_counter() - t0, "workers": [{"index": r.index, **r.body()} for r in replies]}

    def forget(self) -> None:
        """A denoise worker restarted without the copy."""
        self.version = None

    def check(self, params: GenerationParams) -> None:
        if asks_pinned(params) and self.version is None:
            raise FieldError("kl_reference", "no reference is pinned: POST /pin_reference first (a pin is lost "
                                             "when a denoise worker restarts)")
