"""The HTTP front door: FastAPI routes over the router's core (:class:`~router.core.engine.Engine`).

The app is given the engine (``create_app(Engine(config, dispatcher), ...)``): the
launcher builds the dispatcher, so it can hand the dispatcher's exit and
drain hooks to the supervisor and the server itself.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from router.api import answers
from router.api.auth import ApiKeyMiddleware
from router.api.bodies import encode_response, media_response, parse_body, samples_payload, wants_msgpack
from router.api.body_facts import body_facts
from router.api.cancel_api import AbortBody, abort_request, client_gone_mid_body, gone_of
from router.api.drain import ReadBodyFirst
from router.api.http_errors import install_error_handlers
from router.api.media import MEDIA_TYPES, file_types, video_fps
from router.api.metrics import RequestMetrics, exposition
from router.api.openapi import MODULE_QUERY, engine_openapi, errors, ok, request_body
from router.api.request_ids import REQUEST_ID_PARAMETER, REQUEST_ID_PATH, request_id_of
from router.request.schemas import (
    GenerateBody, InitWeightsGroupBody, LoadLoraBody, LoadLoraTensorsBody, RolloutBody, UnloadLoraBody,
    UpdateWeightsBody, UpdateWeightsFromDistributedBody, UpdateWeightsFromTensorsBody,
)
from router.api.sleep_api import SleepRoutes, add_sleep_routes
from router.api.stream import stream_samples
from router.api.web import add_web_routes
from router.core.engine import Engine
from router.core.request_params import makes_sound
from router.openai.routes import OpenAIRoutes, add_openai_routes
from router.peers.sglang.routes import SGLangRoutes, add_sglang_routes
from router.peers.sglang.translate import speaks_sglang
from router.peers.vllm_omni.routes import (
    VllmOmniRoutes, add_vllm_omni_routes, speaks_vllm_omni, speaks_vllm_omni_lora,
)


class Routes:
    """The native endpoints: each parses its request, calls the engine once and answers."""

    def __init__(self, engine: Engine, sglang: SGLangRoutes, vllm_omni: VllmOmniRoutes):
        self.engine, self.limits = engine, engine.config.limits
        # A body in a peer's shape on a route the native API shares is answered by that peer's routes.
        self.sglang, self.vllm_omni = sglang, vllm_omni

    async def health(self) -> JSONResponse:
        health = self.engine.health()
        return JSONResponse(health, status_code=200 if health["ok"] else 503)

    async def generate(self, request: Request) -> Response:
        return await self._run_samples(await self._sample_body(request, GenerateBody), request)

    async def rollout_generate(self, request: Request) -> Response:
        data = await parse_body(request, self.engine.sample_body_limit(True))
        if speaks_sglang(data):
            return await self.sglang.rollout(data, request)
        if speaks_vllm_omni(data):
            return await self.vllm_omni.rollout(data, request)
        return await self._run_samples(RolloutBody.model_validate(data), request)

    async def _sample_body(self, request: Request, schema):
        return schema.model_validate(await parse_body(request, self.engine.sample_body_limit(schema is RolloutBody)))

    async def _body(self, request: Request, schema, limit: int | None = None):
        """The request body as ``schema``; a bad one becomes a 400 naming the field."""
        return schema.model_validate(await parse_body(request, limit or self.limits.max_body_bytes))

    async def _large_body(self, request: Request, schema):
        """A weight update's description: one entry per tensor, so it may exceed the usual body limit."""
        return await self._body(request, schema, self.limits.max_lora_bytes)

    async def update_weights_from_disk(self, request: Request) -> JSONResponse:
        self.engine.check_weights_enabled()  # refused before the body is read: nothing reaches a worker
        data = await parse_body(request, self.limits.max_body_bytes)
        if "model_path" in data or (self.engine.config.peer_api == "sglang" and "path" not in data):  # SGLang's
            return await self.sglang.update_weights_from_disk_body(data)
        body = UpdateWeightsBody.model_validate(data)
        return JSONResponse(await self.engine.update_weights_from_disk(body.module, body.path, body.checksum))

    async def pin_reference(self) -> JSONResponse:
        return JSONResponse(await self.engine.pin_reference())

    async def weights_checksum(self, request: Request) -> JSONResponse:
        # Read by hand like the bodies: a bad value is the router's own 400 (documented in MODULE_QUERY).
        return JSONResponse(await self.engine.weights_checksum(request.query_params.get("module", "transformer")))

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        # An adapter from memory comes as msgpack with its tensors, so it has its own size limit.
        data = await parse_body(request, self.limits.max_lora_bytes)
        if speaks_vllm_omni_lora(data):
            return await self.vllm_omni.load_lora(data)
        schema = LoadLoraTensorsBody if "blob" in data else LoadLoraBody
        return JSONResponse(await self.engine.load_lora(schema.model_validate(data)))

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        data = await parse_body(request, self.limits.max_body_bytes)
        if speaks_vllm_omni_lora(data):
            return await self.vllm_omni.unload_lora(data)
        return JSONResponse(await self.engine.unload_lora(UnloadLoraBody.model_validate(data).lora_name))

    async def lora_adapters(self) -> JSONResponse:
        return JSONResponse(self.engine.lora_adapters())

    # --- weight sync from memory ---------------------------------------------------------------------
    async def weight_sync(self) -> JSONResponse:
        return JSONResponse(self.engine.weight_sync())

    async def update_weights_from_tensors(self, request: Request) -> JSONResponse:
        self.engine.check_memory_sync_enabled()  # refused before the body is read
        body = await self._large_body(request, UpdateWeightsFromTensorsBody)
        return JSONResponse(await self.engine.update_weights_from_tensors(body))

    async def init_weights_group(self, request: Request) -> JSONResponse:
        self.engine.check_memory_sync_enabled()
        return JSONResponse(await self.engine.init_weights_group(await self._body(request, InitWeightsGroupBody)))

    async def update_weights_from_distributed(self, request: Request) -> JSONResponse:
        self.engine.check_memory_sync_enabled()
        data = await parse_body(request, self.limits.max_lora_bytes)
        if "names" in data:  # SGLang's body: names, dtypes, shapes
            return await self.sglang.update_weights_from_distributed_body(data)
        body = UpdateWeightsFromDistributedBody.model_validate(data)
        return JSONResponse(await self.engine.update_weights_from_distributed(body))

    async def destroy_weights_group(self) -> JSONResponse:
        return JSONResponse(await self.engine.destroy_weights_group())

    async def _run_samples(self, body: GenerateBody, request: Request) -> Response:
        if body.stream:  # each sample as it is decoded (router/api/stream.py)
            return await stream_samples(self.engine, body, request)
        rid = request_id_of(request)
        accept = request.headers.get("accept", "")
        if "output_type" not in body.model_fields_set:  # an Accept for a file chooses it; the field wins
            for kind, media_type in MEDIA_TYPES.items():
                if media_type in accept:
                    body = body.model_copy(update={"output_type": kind})
        done = await self.engine.generate(body, rid, gone_of(request))
        params, outcome = done.params, done.outcome
        seeds = [params.sample_seed(i) for i in range(params.n)]
        steps_done = outcome.info.get("steps_done")
        if body.output_type in MEDIA_TYPES and steps_done is None:  # a partial answer holds latents: JSON
            bare = params.n == 1 and params.rollout is None  # a rollout's log-probs need the JSON answer
            fps = video_fps(params, self.engine.info)  # the request's rate where its family takes one
            return await asyncio.to_thread(media_response, rid, seeds, outcome, params.n, body.output_type,
                                           fps, time.perf_counter() - done.started, request, bare)
        payload = samples_payload(rid, seeds, outcome, params.n, time.perf_counter() - done.started,
                                  wants_msgpack(request), uint8=body.output_dtype == "uint8")
        if steps_done is not None:  # a rollout aborted with return_partial: the steps it took
            payload.update(partial=True, steps_done=steps_done)
        return encode_response(payload, request)

    async def abort_request(self, request: Request) -> JSONResponse:
        return await abort_request(self.engine, request, self.limits.max_body_bytes)

    async def progress(self, request: Request) -> JSONResponse:
        """Path parameters are read by hand, like the bodies."""
        return JSONResponse(self.engine.progress(request.path_params["request_id"]))


SAMPLES = ("samples (tensors as {dtype, shape, data}; raw bytes with Accept: application/msgpack), timings, "
           "peak_memory (bytes by stage)")


def add_routes(app: FastAPI, routes: Routes) -> None:
    files = file_types(makes_sound(routes.engine.info)).values()  # audio/wav from a model with sound only
    app.add_api_route("/health", routes.health, methods=["GET"], summary="Workers and their states",
                      responses={**ok(answers.Health, "every worker is ready"),
                                 503: {"model": answers.Health, "description": "not every worker is ready "
                                       "(starting, loading, lost): the same body, ok false"}})
    app.add_api_route("/generate", routes.generate, methods=["POST"], summary="Generate videos (or images)",
                      openapi_extra={**request_body(GenerateBody), "parameters": [REQUEST_ID_PARAMETER]},
                      responses={**ok(answers.Samples, SAMPLES, msgpack=True, media=files),
                                 **errors(400, 401, 409, 413, 429, 499, 500, 503, 504)})
    app.add_api_route("/rollout/generate", routes.rollout_generate, methods=["POST"],
                      summary="Generate with SDE log-probs (and trajectories) for RL",
                      openapi_extra={**request_body(RolloutBody), "parameters": [REQUEST_ID_PARAMETER]},
                      responses={**ok(answers.Samples, SAMPLES, msgpack=True, media=files),
                                 **errors(400, 401, 409, 413, 429, 499, 500, 503, 504)})
    app.add_api_route("/update_weights_from_disk", routes.update_weights_from_disk, methods=["POST"],
                      summary="Load new weights into every denoise worker",
                      openapi_extra=request_body(UpdateWeightsBody),
                      responses={**ok(answers.WeightsUpdated, "the new weight_version and each worker's checksum"),
                                 **errors(400, 401, 403, 413, 500, 503, 504)})
    app.add_api_route("/weights_checksum", routes.weights_checksum, methods=["GET"],
                      summary="SHA-256 of a module's weights on every denoise worker", openapi_extra=MODULE_QUERY,
                      responses={**ok(answers.Checksums, "checksums, and whether every worker agrees"),
                                 **errors(400, 401, 500, 503, 504)})
    app.add_api_route("/pin_reference", routes.pin_reference, methods=["POST"],
                      summary="Copy every denoise worker's weights as the reference of kl_reference: pinned",
                      responses={**ok(answers.ReferencePinned, "the pinned weight_version and each worker's copy"),
                                 **errors(400, 401, 403, 500, 503, 504)})
    app.add_api_route("/abort_request", routes.abort_request, methods=["POST"],
                      summary="Cancel a request in flight by its X-Request-Id (rid), or every one (abort_all, admin)",
                      openapi_extra=request_body(AbortBody),
                      responses={**ok(answers.Aborted, "the ids of the requests cancelled"),
                                 **errors(400, 401, 403, 404, 413)})
    app.add_api_route("/progress/{request_id}", routes.progress, methods=["GET"],
                      summary="Where a request sent with X-Request-Id is: stage, denoising step, 0-100",
                      openapi_extra=REQUEST_ID_PATH, responses={**ok(answers.Progress), **errors(401, 404)})
    add_lora_routes(app, routes)
    add_weight_sync_routes(app, routes)
    add_sleep_routes(app, SleepRoutes(routes.engine))


def add_weight_sync_routes(app: FastAPI, routes: Routes) -> None:
    updated = "the new weight_version and each worker's checksum"
    app.add_api_route("/weight_sync", routes.weight_sync, methods=["GET"],
                      summary="Whether weight sync from memory is on, the shared-memory prefix for buckets, the group",
                      responses={**ok(answers.WeightSyncInfo), **errors(401)})
    app.add_api_route("/update_weights_from_tensors", routes.update_weights_from_tensors, methods=["POST"],
                      summary="Load the trainer's tensors from shared-memory buckets into every denoise worker",
                      openapi_extra=request_body(UpdateWeightsFromTensorsBody),
                      responses={**ok(answers.WeightsUpdated, updated), **errors(400, 401, 403, 413, 500, 503, 504)})
    app.add_api_route("/init_weights_group", routes.init_weights_group, methods=["POST"],
                      summary="Every denoise worker joins the trainer's torch.distributed group (trainer: rank 0)",
                      openapi_extra=request_body(InitWeightsGroupBody),
                      responses={**ok(answers.GroupJoined, "world size and ranks"),
                                 **errors(400, 401, 403, 500, 503, 504)})
    app.add_api_route("/update_weights_from_distributed", routes.update_weights_from_distributed, methods=["POST"],
                      summary="Announce an update the trainer then broadcasts over the weights group",
                      openapi_extra=request_body(UpdateWeightsFromDistributedBody),
                      responses={**ok(answers.WeightsUpdated, updated), **errors(400, 401, 403, 413, 500, 503, 504)})
    app.add_api_route("/destroy_weights_group", routes.destroy_weights_group, methods=["POST"],
                      summary="Leave the weights group",
                      responses={**ok(answers.GroupDestroyed), **errors(401, 403, 500, 503, 504)})


def add_lora_routes(app: FastAPI, routes: Routes) -> None:
    app.add_api_route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"],
                      summary="Load (or replace) a LoRA adapter in every denoise worker",
                      openapi_extra=request_body(LoadLoraBody, LoadLoraTensorsBody),
                      responses={**ok(answers.LoraLoaded, "the adapter's lora_version, rank, target modules, "
                                      "experts and sha256"), **errors(400, 401, 403, 413, 500, 503, 504)})
    app.add_api_route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"],
                      summary="Unload a LoRA adapter", openapi_extra=request_body(UnloadLoraBody),
                      responses={**ok(answers.LoraUnloaded), **errors(400, 401, 403, 500, 503, 504)})
    app.add_api_route("/v1/lora_adapters", routes.lora_adapters, methods=["GET"], summary="The loaded LoRA adapters",
                      responses={**ok(answers.LoraAdapters), **errors(401)})


def _lifespan(engine: Engine, api: OpenAIRoutes):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start(api.rerun)  # the video jobs an earlier start left unfinished run again
        yield
        await engine.stop()

    return lifespan


def create_app(engine: Engine, *, api_key: str | None = None, admin_key: str | None = None) -> FastAPI:
    """The router app over ``engine``, which it starts and stops with itself. ``api_key`` / ``admin_key``: see
    :mod:`router.api.auth` (never part of the engine's config)."""
    sglang, vllm_omni = SGLangRoutes(engine), VllmOmniRoutes(engine)
    routes = Routes(engine, sglang, vllm_omni)
    api = OpenAIRoutes(engine)
    # /docs from the package's own Swagger UI files (router/api/web.py), not a CDN; no ReDoc (a CDN's too).
    app = FastAPI(title="disagg-diffusion", lifespan=_lifespan(engine, api), docs_url=None, redoc_url=None)
    app.add_middleware(RequestMetrics, metrics=engine.metrics)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_key=admin_key)
    app.add_middleware(ReadBodyFirst)  # outermost: every early answer (413, 401, 404, ...) reads the body first
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnect, client_gone_mid_body)  # one log line, no traceback
    add_sglang_routes(app, sglang, root_memory=engine.config.peer_api == "sglang")  # first: they win at the root
    add_vllm_omni_routes(app, vllm_omni)
    add_routes(app, routes)
    add_openai_routes(app, api)
    add_web_routes(app)  # the page at / and /docs
    app.add_api_route("/metrics", lambda: exposition(engine.metrics), methods=["GET"],
                      summary="Prometheus metrics (text exposition format)", response_class=Response,
                      responses={**ok(None, "the text exposition format", media=["text/plain"]), **errors(401)})
    app.openapi = engine_openapi(app, body_facts(engine.config, engine.info))  # this engine's limits in the schema
    return app
