"""vLLM-Omni's stage-aware RL routes (``vllm_omni/entrypoints/openai/rl_api.py``) over the engine.

This engine is one diffusion stage, stage 0. Every route is served under ``/vllm-omni`` (a client's base URL
``http://HOST:PORT/vllm-omni``); at the root too where the native API leaves the path free. The native root
routes a vLLM-Omni client shares hand a request over when it is unambiguously vLLM-Omni's: ``/rollout/generate``
with ``sampling_params``, ``stage_id``, ``request_id`` or ``transport``; ``/sleep`` and ``/wake_up`` with a
``stage_ids`` query; a LoRA body with ``stage_ids``, ``lora_int_id``, ``load_inplace`` or ``is_3d_lora_weight``;
SGLang's ``/get_weights_checksum`` with ``stage_ids`` or ``component``.

Errors come in the engine's shape (``{"error": {..., "field"}}``), as vLLM's full server nests its own.
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from router.api.auth import ADMIN_SCOPE
from router.api.bodies import decode_body, parse_body, read_limited
from router.api.cancel_api import gone_of
from router.api.http_errors import first_error
from router.api.openapi import errors, ok, request_body
from router.request.schemas import RolloutBody
from router.core.engine import Engine
from router.core.errors import EngineError, FieldError
from router.peers.vllm_omni import answer, control, schemas as s
from router.peers.vllm_omni.translate import ONE_STAGE, STAGE_ID, native_body

PREFIX = "/vllm-omni"
LORA_KEYS = ("stage_ids", "lora_int_id", "load_inplace", "is_3d_lora_weight")  # no native LoRA body has these


def speaks_vllm_omni(body: dict) -> bool:
    """Whether a ``/rollout/generate`` body is vLLM-Omni's (its own fields)."""
    return any(k in body for k in ("sampling_params", "stage_id", "request_id", "transport"))


def speaks_vllm_omni_lora(body: dict) -> bool:
    """Whether a LoRA load / unload body is vLLM-Omni's."""
    return any(k in body for k in LORA_KEYS)


def speaks_vllm_omni_checksum(body: dict) -> bool:
    """Whether a ``/get_weights_checksum`` body is vLLM-Omni's (SGLang's has ``module_names``)."""
    return "stage_ids" in body or "component" in body


def _admin(request: Request) -> None:
    """Routes that change the engine need the admin key where there is one (router/api/auth.py guards the
    native paths; these decide here, as ``/abort_request``'s ``abort_all``)."""
    if not request.scope.get(ADMIN_SCOPE, True):
        raise EngineError(403, "forbidden", f"{request.url.path} needs the admin key", "router", "")


class VllmOmniRoutes:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.limits = engine.config.limits
        self.segments = answer.Segments()
        self.transfer = control.WeightTransfer(engine)
        self.lora_ids: dict[str, int] = {}  # adapters loaded through these routes: their lora_int_id

    async def _data(self, request: Request, limit: int | None = None) -> dict:
        """The body as a dict; none (or ``null``): {}."""
        raw = await read_limited(request, limit or self.limits.max_body_bytes)
        return decode_body(raw, request) if raw.strip() not in (b"", b"null") else {}

    # --- rollouts ---------------------------------------------------------------------------------------
    async def rollout_generate(self, request: Request) -> Response:
        return await self.rollout(await parse_body(request, self.engine.sample_body_limit(True)), request)

    async def rollout(self, data: dict, request: Request) -> Response:
        """A rollout in vLLM-Omni's body; its answer: the trajectory in shared-memory handles."""
        engine = self.engine
        req = s.OmniRolloutRequest.model_validate(data)
        native, plan = native_body(req, engine.info)
        try:
            body = RolloutBody.model_validate(native)
        except ValidationError as e:
            field, message = first_error(e.errors())
            raise FieldError(plan.peer_field(field), message.split(": ", 1)[-1]) from None
        try:
            done = await engine.generate(body, plan.request_id, gone_of(request))
        except EngineError as e:
            if e.type == "request_id_in_use":
                e.field = "request_id"
            elif e.field is not None:
                peer = plan.peer_field(e.field)
                e.message = e.message.replace(f"{e.field}: ", f"{peer}: ", 1)
                e.field = peer
            raise
        handles = await self.segments.write(answer.arrays(done.outcome, plan))
        return JSONResponse({"request_id": plan.request_id, "stage_id": STAGE_ID, "transport": "shm",
                             "handles": handles,
                             "metrics": answer.metrics(done.outcome, plan, time.perf_counter() - done.started)},
                            headers={"X-Request-Id": plan.request_id})

    # --- pause, resume, aborts --------------------------------------------------------------------------
    async def pause(self, request: Request) -> JSONResponse:
        """vLLM's ``mode`` (abort, wait; keep: as wait), ``wait_for_inflight_requests`` (wait),
        ``clear_cache`` (nothing here depends on the weights a pause is for: accepted)."""
        _admin(request)
        mode = request.query_params.get("mode", "abort")
        if control.bool_param(request, "wait_for_inflight_requests", False):
            mode = "wait"
        control.bool_param(request, "clear_cache", True)
        await control.pause(self.engine, mode)
        return JSONResponse({"status": "paused"})

    async def resume(self, request: Request) -> JSONResponse:
        _admin(request)
        self.engine.pause.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(self) -> JSONResponse:
        return JSONResponse(self.engine.pause.status())

    async def abort_requests(self, request: Request) -> JSONResponse:
        """The ids given (each in flight cancelled; ``aborted`` counts the ids sent, as the peer's), else every
        generation in flight (the admin's)."""
        body = s.AbortRequestsRequest.model_validate(await self._data(request))
        if body.request_ids:
            for rid in body.request_ids:
                try:
                    self.engine.cancel(rid)
                except EngineError:
                    pass  # not in flight (unknown, or answered already)
            return JSONResponse({"status": "aborted", "aborted": len(body.request_ids)})
        _admin(request)
        return JSONResponse({"status": "aborted", "aborted": len(self.engine.abort_all())})

    # --- weights ----------------------------------------------------------------------------------------
    async def init_weight_transfer_engine(self, request: Request) -> JSONResponse:
        _admin(request)
        return self.transfer.init(s.WeightTransferBody.model_validate(await self._data(request)).init_info)

    async def start_weight_update(self, request: Request) -> JSONResponse:
        _admin(request)
        await self._data(request)
        return self.transfer.start()

    async def start_draft_weight_update(self, request: Request) -> JSONResponse:
        _admin(request)
        await self._data(request)
        raise control.out_of_order("Diffusion stages do not have draft-model weights (this engine is one "
                                   "diffusion stage)")

    async def update_weights(self, request: Request) -> JSONResponse:
        _admin(request)
        return await self.transfer.update(s.WeightUpdateBody.model_validate(await self._data(request)).update_info)

    async def finish_weight_update(self, request: Request) -> JSONResponse:
        _admin(request)
        s.FinishWeightUpdateBody.model_validate(await self._data(request))
        return self.transfer.finish()

    async def get_weights_checksum(self, request: Request) -> JSONResponse:
        return await control.weights_checksum(self.engine, await self._data(request))

    # --- topology, caches, server info ------------------------------------------------------------------
    def topology(self, include_dp: bool = True) -> dict:
        workers = self.engine.config.of_role("denoise")
        per_worker = max((w.ranks for w in workers), default=1)
        world = sum(w.ranks for w in workers) if include_dp else per_worker
        stage = {"stage_id": STAGE_ID, "stage_type": "diffusion", "model_stage": "diffusion", "world_size": world,
                 "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                 "data_parallel_size": len(workers) if include_dp else 1,
                 "sequence_parallel_size": max((w.ulysses * w.ring for w in workers), default=1),
                 "cfg_parallel_size": 2 if any(w.cfg_parallel for w in workers) else 1}
        return {"world_size": world, "stages": [stage]}

    async def get_world_size(self, request: Request) -> JSONResponse:
        include_dp = control.bool_param(request, "include_dp", True)
        stage_id = control.int_param(request, "stage_id", None)
        if stage_id is not None and stage_id != STAGE_ID:
            raise EngineError(404, "not_found", f"Unknown stage_id: {stage_id} ({ONE_STAGE})", "router", "",
                              field="stage_id")
        return JSONResponse(self.topology(include_dp))

    async def reset_cache(self, request: Request) -> Response:
        """Nothing to reset: the encoder's prompt cache holds the text encoders' outputs, which a weight update
        of the denoiser leaves as they are; no prefix, multimodal or encoder cache depends on them."""
        control.stage_ids(request)
        control.bool_param(request, "reset_external", False)
        control.bool_param(request, "reset_running_requests", False)
        return Response(status_code=200, media_type="text/plain")

    async def server_info(self) -> JSONResponse:
        engine = self.engine
        return JSONResponse({
            "omni_rl": {"stage_aware": True, "rollout_transport": "shm", "topology": self.topology()},
            "engine": {"model": str(engine.info.path), "family": engine.info.family.family,
                       "pipeline": engine.info.family.pipeline, "weight_version": engine.weights.version},
            "shm": self.segments.outstanding()})

    # --- memory -----------------------------------------------------------------------------------------
    async def sleep(self, request: Request) -> Response:
        _admin(request)
        await self._data(request)
        return await control.sleep(self.engine, request)

    async def wake_up(self, request: Request) -> Response:
        _admin(request)
        await self._data(request)
        return await control.wake_up(self.engine, request)

    async def is_sleeping(self) -> JSONResponse:
        return JSONResponse(control.sleep_status(self.engine))

    async def omni_sleep(self, request: Request) -> JSONResponse:
        _admin(request)
        return await control.omni_sleep(self.engine, await self._data(request))

    async def omni_wakeup(self, request: Request) -> JSONResponse:
        _admin(request)
        return await control.omni_wakeup(self.engine, await self._data(request))

    # --- LoRA -------------------------------------------------------------------------------------------
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        _admin(request)
        return await self.load_lora(await self._data(request))

    async def load_lora(self, data: dict) -> JSONResponse:
        return await control.load_lora(self.engine, self.lora_ids, data)

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        _admin(request)
        return await self.unload_lora(await self._data(request))

    async def unload_lora(self, data: dict) -> JSONResponse:
        return await control.unload_lora(self.engine, self.lora_ids, data)


def _query(*params: tuple[str, str, str]) -> dict:
    """``openapi_extra`` of query parameters: (name, JSON type, description); ``[]`` types are repeatable."""
    out = []
    for name, kind, description in params:
        schema = {"type": "array", "items": {"type": kind[:-2]}} if kind.endswith("[]") else {"type": kind}
        out.append({"name": name, "in": "query", "required": False, "description": description, "schema": schema})
    return {"parameters": out}


STAGES = ("stage_ids", "integer[]", f"repeatable; {ONE_STAGE}")
EMPTY = ok(None, "an empty body", media=["text/plain"])


def add_vllm_omni_routes(app: FastAPI, routes: VllmOmniRoutes) -> None:
    """Every route under ``/vllm-omni``; at the root those the native API leaves free."""
    acks = {**ok(s.Acks), **errors(400, 401, 403, 500, 503, 504)}
    table = [  # path, method, handler, openapi_extra, responses, at the root
        ("/rollout/generate", "POST", routes.rollout_generate, request_body(s.OmniRolloutRequest),
         {**ok(s.RolloutAnswer), **errors(400, 401, 409, 413, 429, 499, 500, 503, 504)}, False),
        ("/pause", "POST", routes.pause, _query(("mode", "string", "abort, wait or keep (as wait)"),
                                                ("wait_for_inflight_requests", "boolean", "true: mode wait"),
                                                ("clear_cache", "boolean", "accepted")),
         {**ok(s.Status), **errors(400, 401, 403, 504)}, True),
        ("/resume", "POST", routes.resume, None, {**ok(s.Status), **errors(401, 403)}, True),
        ("/is_paused", "GET", routes.is_paused, None, {**ok(s.PauseStatus), **errors(401)}, True),
        ("/abort_requests", "POST", routes.abort_requests, request_body(s.AbortRequestsRequest),
         {**ok(s.Aborted), **errors(400, 401, 403, 413)}, True),
        ("/init_weight_transfer_engine", "POST", routes.init_weight_transfer_engine,
         request_body(s.WeightTransferBody), acks, True),
        ("/start_weight_update", "POST", routes.start_weight_update, None, acks, True),
        ("/start_draft_weight_update", "POST", routes.start_draft_weight_update, None, acks, True),
        ("/update_weights", "POST", routes.update_weights, request_body(s.WeightUpdateBody), acks, True),
        ("/finish_weight_update", "POST", routes.finish_weight_update, request_body(s.FinishWeightUpdateBody),
         acks, True),
        ("/get_weights_checksum", "POST", routes.get_weights_checksum, request_body(s.WeightsChecksumRequest),
         acks, False),  # the root's is SGLang's, which hands vLLM-Omni's bodies over
        ("/get_world_size", "GET", routes.get_world_size, _query(("stage_id", "integer", ONE_STAGE),
                                                                 ("include_dp", "boolean", "default true")),
         {**ok(s.WorldSize), **errors(400, 401, 404)}, True),
        ("/server_info", "GET", routes.server_info, None, {**ok(s.ServerInfo), **errors(401)}, True),
        ("/sleep", "POST", routes.sleep, _query(("level", "integer", "1: weights to host memory; 2: dropped"),
                                                ("mode", "string", "abort, wait or keep (as wait)"), STAGES),
         {**EMPTY, **errors(400, 401, 403, 500, 504)}, False),
        ("/wake_up", "POST", routes.wake_up, _query(("tags", "string[]", "weights, transformer, text_encoder, "
                                                     "vae; kv_cache: nothing"),
                                                    ("reload", "string", "disk: weights dropped and not pushed "
                                                     "come from the model directory"), STAGES),
         {**EMPTY, **errors(400, 401, 403, 409, 500, 504)}, False),
        ("/is_sleeping", "GET", routes.is_sleeping, None, {**ok(s.SleepStatus), **errors(401)}, False),
        ("/v1/omni/sleep", "POST", routes.omni_sleep, request_body(s.OmniSleepRequest),
         {**ok(s.OmniSleepAnswer), **errors(400, 401, 403, 500, 504)}, True),
        ("/v1/omni/wakeup", "POST", routes.omni_wakeup, request_body(s.OmniWakeupRequest),
         {**ok(s.OmniSleepAnswer), **errors(400, 401, 403, 409, 500, 504)}, True),
        ("/v1/load_lora_adapter", "POST", routes.load_lora_adapter, request_body(s.LoadLoRARequest), acks, False),
        ("/v1/unload_lora_adapter", "POST", routes.unload_lora_adapter, request_body(s.UnloadLoRARequest),
         acks, False),
    ]
    for path in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
        table.append((path, "POST", routes.reset_cache,
                      _query(STAGES, ("reset_external", "boolean", "accepted"),
                             ("reset_running_requests", "boolean", "accepted")),
                      {**EMPTY, **errors(400, 401)}, True))
    tags = ["vLLM-Omni RL"]
    for path, method, handler, extra, responses, at_root in table:
        for where in (PREFIX + path, path) if at_root else (PREFIX + path,):
            empty = "text/plain" in responses[200].get("content", {})
            app.add_api_route(where, handler, methods=[method], tags=tags, summary=f"vLLM-Omni's {path}",
                              openapi_extra=extra, responses=responses,
                              response_class=Response if empty else JSONResponse)
