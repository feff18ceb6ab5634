"""What each of :class:`router.client.EngineClient`'s paths calls on the router's core, for the local engine.

The same bodies (router/request/schemas.py), the same core calls and the same answers (router/api/bodies.py's
samples payload, tensors as raw bytes) as the HTTP routes of router/api/app.py, without a request or a response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from router.api.bodies import sample_body, samples_payload
from router.api.cancel_api import AbortBody
from router.api.http_errors import first_error
from router.api.media import MEDIA_TYPES
from router.core.engine import Engine
from router.core.errors import EngineError, FieldError
from router.request.schemas import (
    GenerateBody, InitWeightsGroupBody, LoadLoraBody, LoadLoraTensorsBody, ReleaseMemoryBody, ResumeMemoryBody,
    RolloutBody, UnloadLoraBody, UpdateWeightsBody, UpdateWeightsFromDistributedBody, UpdateWeightsFromTensorsBody,
)

SAMPLE_PATHS = {"/generate": GenerateBody, "/rollout/generate": RolloutBody}


class Routes:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.posts = {
            "/abort_request": self._abort, "/update_weights_from_disk": self._from_disk,
            "/pin_reference": lambda body: engine.pin_reference(),
            "/release_memory_occupation": self._release, "/resume_memory_occupation": self._resume,
            "/v1/load_lora_adapter": self._load_lora,
            "/v1/unload_lora_adapter": lambda body: engine.unload_lora(UnloadLoraBody.model_validate(body).lora_name),
            "/update_weights_from_tensors": self._from_tensors, "/init_weights_group": self._init_group,
            "/update_weights_from_distributed": self._from_group,
            "/destroy_weights_group": lambda body: engine.destroy_weights_group(),
        }
        self.gets = {
            "/v1/models": lambda q: engine.models(), "/weights_checksum": lambda q: engine.weights_checksum(
                q.get("module", "transformer")),
            "/is_sleeping": lambda q: engine.sleep_state(), "/v1/lora_adapters": lambda q: engine.lora_adapters(),
            "/weight_sync": lambda q: engine.weight_sync(),
        }

    @staticmethod
    def first_error(e: ValidationError) -> tuple[str, str]:
        return first_error(e.errors())

    async def rerun_job(self, row, request: dict):
        """Video jobs are the OpenAI API's, which a local engine does not serve (its data dir is its own)."""
        raise FieldError("model", "a local engine runs no stored video jobs")

    # --- the paths --------------------------------------------------------------------------------------
    async def post(self, path: str, body: dict[str, Any], request_id: str) -> dict:
        if path in SAMPLE_PATHS:
            return await self._samples(SAMPLE_PATHS[path].model_validate(body), request_id)
        handler = self.posts.get(path)
        if handler is None:
            raise EngineError(404, "not_found", f"no route {path}", "router", request_id)
        out = handler(body)
        return await out if asyncio.iscoroutine(out) else out

    async def get(self, path: str, query: dict[str, str]) -> dict:
        handler = self.gets.get(path)
        if handler is None:
            raise EngineError(404, "not_found", f"no route {path}", "router", "")
        out = handler(query)
        return await out if asyncio.iscoroutine(out) else out

    async def _samples(self, body: GenerateBody, request_id: str) -> dict:
        _tensors_only(body)
        done = await self.engine.generate(body, request_id)
        params, outcome = done.params, done.outcome
        seeds = [params.sample_seed(i) for i in range(params.n)]
        payload = samples_payload(request_id, seeds, outcome, params.n, time.perf_counter() - done.started, True,
                                  uint8=body.output_dtype == "uint8")
        if (steps_done := outcome.info.get("steps_done")) is not None:
            payload.update(partial=True, steps_done=steps_done)
        return payload

    async def stream(self, path: str, body: dict[str, Any], request_id: str) -> AsyncIterator[dict]:
        """Each sample as it is decoded, then the request's ``done`` item (router/api/stream.py's items)."""
        parsed = SAMPLE_PATHS[path].model_validate(body)
        _tensors_only(parsed)
        params, images = await self.engine.prepare(parsed)
        seeds, uint8 = [params.sample_seed(i) for i in range(params.n)], parsed.output_dtype == "uint8"
        arrived: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.engine.generate_prepared(
            parsed, params, images, request_id, None, lambda i, outcome: arrived.put_nowait((i, outcome))))
        sent: set[int] = set()
        while not (task.done() and arrived.empty()):
            getter = asyncio.ensure_future(arrived.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            i, outcome = getter.result()
            if i not in sent:
                sent.add(i)
                yield {"index": i, **sample_body(seeds[i], outcome, True, uint8=uint8)}
        try:
            done = task.result()
        except EngineError as e:
            if not sent:
                raise
            yield {"done": True, "error": {"type": e.type, "message": e.message, "stage": e.stage,
                                           "request_id": request_id}}
            return
        for i in range(params.n):  # those no SampleDone brought
            if i not in sent:
                yield {"index": i, **sample_body(seeds[i], done.outcome.sample(i), True, uint8=uint8)}
        whole = samples_payload(request_id, seeds, done.outcome, 0, time.perf_counter() - done.started, True)
        whole.pop("samples")
        yield {"done": True, **whole}

    # --- controls: as router/api/app.py calls them ---------------------------------------------------------
    def _abort(self, body: dict) -> dict:
        parsed = AbortBody.model_validate(body)
        if parsed.abort_all:
            return {"aborted": self.engine.abort_all()}
        if parsed.rid is None:
            raise FieldError("rid", "give the request's id (its request_id), or abort_all")
        return {"aborted": self.engine.cancel(parsed.rid)}

    def _from_disk(self, body: dict):
        self.engine.check_weights_enabled()
        parsed = UpdateWeightsBody.model_validate(body)
        return self.engine.update_weights_from_disk(parsed.module, parsed.path, parsed.checksum)

    def _release(self, body: dict):
        parsed = ReleaseMemoryBody.model_validate(body)
        return self.engine.release_memory(parsed.tags, parsed.level, parsed.mode)

    def _resume(self, body: dict):
        parsed = ResumeMemoryBody.model_validate(body)
        return self.engine.resume_memory(parsed.tags, parsed.reload)

    def _load_lora(self, body: dict):
        return self.engine.load_lora((LoadLoraTensorsBody if "blob" in body else LoadLoraBody).model_validate(body))

    def _from_tensors(self, body: dict):
        self.engine.check_memory_sync_enabled()
        return self.engine.update_weights_from_tensors(UpdateWeightsFromTensorsBody.model_validate(body))

    def _init_group(self, body: dict):
        self.engine.check_memory_sync_enabled()
        return self.engine.init_weights_group(InitWeightsGroupBody.model_validate(body))

    def _from_group(self, body: dict):
        self.engine.check_memory_sync_enabled()
        return self.engine.update_weights_from_distributed(UpdateWeightsFromDistributedBody.model_validate(body))


def _tensors_only(body: GenerateBody) -> None:
    if body.output_type in MEDIA_TYPES:
        raise FieldError("output_type", f"a local engine answers tensors: {body.output_type!r} is a file the HTTP "
                         "API makes; ask for frames or latent")
