"""Streamed answers (``stream: true``): each sample as soon as it is decoded, then the request's own facts.

One item per sample, ``{"index": i, ...the sample as in the whole answer}``, in the order they finish, then a last
``{"done": true, "request_id", "timings", "peak_memory", "weight_version", "attempts"[, "conditioning"]}``. A
failure after the first item ends the stream with ``{"done": true, "error": {...}}`` (before it, the usual JSON
error and status). JSON lines (``application/x-ndjson``), or with ``Accept: application/msgpack`` msgpack maps
back to back (``msgpack.Unpacker`` reads them one by one).

Every sample comes exactly once: those a run streamed are not sent again when its answer (or a re-run's, after
a worker died) arrives. A client that goes away cancels the rest of the request, as for a whole answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import msgpack
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from router.api.bodies import MSGPACK, samples_payload, sample_body, wants_msgpack
from router.api.cancel_api import gone_of
from router.api.request_ids import request_id_of
from router.request.schemas import GenerateBody
from router.core.engine import Engine
from router.core.errors import EngineError
from router.link.join import Outcome

NDJSON = "application/x-ndjson"


class _Watch:
    """The client's disconnect: watched here until the stream starts, by the server's own listener after (its
    end of the stream sets ``left``)."""

    def __init__(self, request: Request):
        self.left = asyncio.Event()
        self._before = asyncio.ensure_future(gone_of(request)())

    def streaming(self) -> None:
        self._before.cancel()

    async def gone(self) -> None:
        left = asyncio.ensure_future(self.left.wait())
        try:
            await asyncio.wait({self._before, left}, return_when=asyncio.FIRST_COMPLETED)
            if self._before.cancelled():
                await left
        finally:
            left.cancel()


async def stream_samples(engine: Engine, body: GenerateBody, request: Request) -> Response:
    """The streamed answer of ``body`` (``stream: true``); a request refused before its first sample gets the
    usual error answer."""
    rid, binary = request_id_of(request), wants_msgpack(request)
    uint8 = body.output_dtype == "uint8"
    params, images = await engine.prepare(body)  # a bad field: 400 here, nothing started
    seeds = [params.sample_seed(i) for i in range(params.n)]
    arrived: asyncio.Queue = asyncio.Queue()
    watch = _Watch(request)
    task = asyncio.ensure_future(engine.generate_prepared(
        body, params, images, rid, watch.gone, lambda i, outcome: arrived.put_nowait((i, outcome))))
    first = await _next(arrived, task)
    if first is None and task.exception() is not None:  # refused or failed before any sample: the usual error
        watch.streaming()
        raise task.exception()
    watch.streaming()

    def encode(item: dict) -> bytes:
        return msgpack.packb(item, use_bin_type=True) if binary else (json.dumps(item) + "\n").encode()

    def sample(i: int, outcome: Outcome) -> bytes:
        return encode({"index": i, **sample_body(seeds[i], outcome, binary, uint8=uint8)})

    async def items() -> AsyncIterator[bytes]:
        sent: set[int] = set()
        try:
            item = first
            while item is not None:
                i, outcome = item
                if i not in sent:
                    sent.add(i)
                    yield sample(i, outcome)
                item = await _next(arrived, task)
            try:
                done = task.result()
            except EngineError as e:
                yield encode({"done": True, "error": {"type": e.type, "message": e.message, "stage": e.stage,
                                                      "request_id": rid}})
                return
            for i in range(params.n):  # those no SampleDone brought (latents, one sample, a lost notice)
                if i not in sent:
                    sent.add(i)
                    yield sample(i, done.outcome.sample(i))
            whole = samples_payload(rid, seeds, done.outcome, 0, time.perf_counter() - done.started, binary)
            whole.pop("samples")
            yield encode({"done": True, **whole})
        finally:
            if not task.done():  # the client went away mid-stream: the rest of the request is cancelled
                watch.left.set()
                await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: a 499 after a disconnect is nobody's to read

    return StreamingResponse(items(), media_type=MSGPACK if binary else NDJSON, headers={"X-Request-Id": rid})


async def _next(arrived: asyncio.Queue, task: asyncio.Future) -> tuple[int, Outcome] | None:
    """The next streamed sample, or None once the request is answered (and nothing more is queued)."""
    if not arrived.empty():
        return arrived.get_nowait()
    if task.done():
        return None
    getter = asyncio.ensure_future(arrived.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return arrived.get_nowait() if not arrived.empty() else None
