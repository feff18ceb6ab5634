"""The HTTP front door: FastAPI routes over a :class:`~router.link.dispatcher.Dispatcher`.

The app is given its pieces (``create_app(config, dispatcher, ...)``): the
launcher builds the dispatcher, so it can hand the dispatcher's exit and
drain hooks to the supervisor and the server itself.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from common.config.engine import EngineConfig
from common.diffusion.cache_signals import cache_problem
from common.diffusion.model_info import ModelInfo
from common.families import read_model
from common.protocol.messages import EXPERT_NAMES, REQUEST_IMAGES
from router.api.auth import ApiKeyMiddleware
from router.link.cancel import AbortBody, Cancellations, client_gone_mid_body
from router.api.bodies import encode_response, media_response, parse_body, samples_payload, wants_msgpack
from router.control.fanout import WeightControl
from router.link.dispatcher import Dispatcher
from router.api.drain import ReadBodyFirst
from router.control.lora import LoraControl
from router.api.media import MEDIA_TYPES
from router.api.metrics import EngineState, Metrics, RequestMetrics
from router.api.http_errors import error_response, install_error_handlers
from router.openai.job_store import JobStore
from router.openai.routes import OpenAIRoutes, add_openai_routes
from router.api import answers
from router.api.body_facts import body_facts
from router.api.openapi import MODULE_QUERY, engine_openapi, errors, ok, request_body
from router.core.progress import REQUEST_ID_PARAMETER, REQUEST_ID_PATH, InFlight, request_id_of
from router.api.schemas import (
    FieldError, GenerateBody, InitWeightsGroupBody, LoadLoraBody, LoadLoraTensorsBody, RolloutBody, UnloadLoraBody,
    UpdateWeightsBody, UpdateWeightsFromDistributedBody, UpdateWeightsFromTensorsBody, checked_module,
    checked_weight_path,
)
from router.api.images import decode_image
from router.core.request_params import check_family_fields, check_image_fields, check_model_fields, to_params
from router.control.sleep import SleepControl
from router.api.sleep_api import SleepRoutes, add_sleep_routes
from router.api.web import add_web_routes
from router.control.weight_sync import MemorySync

WEIGHTS_DISABLED = "weight updates are disabled: start the engine with --weight-root DIR"


class Routes:
    """The endpoint handlers, over the dispatcher and the model's facts."""

    def __init__(self, config: EngineConfig, dispatcher: Dispatcher, info: ModelInfo):
        self.config, self.dispatcher, self.info = config, dispatcher, info
        self.weights = WeightControl(dispatcher.control)
        self.loras = LoraControl(dispatcher.control)
        self.memory = MemorySync(config, dispatcher.control, self.weights, self.loras)
        experts = EXPERT_NAMES if info.has_transformer_2 else EXPERT_NAMES[:1]
        self.sleep = SleepControl(dispatcher, self.weights, experts)
        self.metrics = Metrics()
        self.in_flight = InFlight(dispatcher.pending, config.limits.max_attempts)  # GET /progress/{id}
        self.cancels = Cancellations(dispatcher.cancel_partial, lambda why: self.metrics.cancelled.labels(why).inc())
        dispatcher.cancelled = self.cancels.cancelled
        self.weights.on_supplied = self.loras.on_supplied = self._supplied
        dispatcher.on_worker_back = self._worker_back

    async def _worker_back(self, worker) -> None:
        """A restarted denoise worker gets the weight updates and the adapters its predecessor held. What
        only the trainer's memory held (weights or adapters it pushed) it cannot get: it is stale, not
        routed to, until the trainer pushes each of those again."""
        if worker.role == LoraControl.role:
            missing = await self.weights.replay(worker) | await self.loras.replay(worker)
            if missing:
                self.dispatcher.registry.lacks(worker.role, worker.index, missing)
        await self.sleep.worker_back(worker)  # one restarted while asleep stays asleep

    def _supplied(self, item: str) -> None:
        self.dispatcher.registry.supplied(LoraControl.role, item)
        self.sleep.supplied(item)

    async def health(self) -> JSONResponse:
        ok, workers = self.dispatcher.health()
        return JSONResponse({"ok": ok, "model": str(self.info.path), "family": self.info.family.family,
                             "pipeline": self.info.family.pipeline, "workers": workers},
                            status_code=200 if ok else 503)

    async def generate(self, request: Request) -> Response:
        return await self._run_samples(await self._sample_body(request, GenerateBody), request)

    async def rollout_generate(self, request: Request) -> Response:
        return await self._run_samples(await self._sample_body(request, RolloutBody), request)

    async def _sample_body(self, request: Request, schema):
        return schema.model_validate(await parse_body(request, self.sample_body_limit()))

    def sample_body_limit(self) -> int:
        """A generation body's size limit; on an image-to-video model, larger by its images' base64."""
        limits = self.config.limits
        if self.info.family.condition.image_input(self.info) is None:
            return limits.max_body_bytes
        return limits.max_body_bytes + 2 * (4 * -(-limits.max_image_bytes // 3))

    async def images_of(self, body: GenerateBody, names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """The request's images as RGB pixels (decoded off the event loop), by field; checked already by
        :meth:`params_for` against what the model takes. ``names``: what the caller calls a field (errors)."""
        limits, out = self.config.limits, {}
        for field in REQUEST_IMAGES:
            value = getattr(body, field.name)
            if value is not None:
                name = (names or {}).get(field.name, field.name)
                pixels = await asyncio.to_thread(decode_image, value, name, max_bytes=limits.max_image_bytes,
                                                 max_pixels=limits.max_image_pixels)
                out[field.name] = torch.from_numpy(pixels)
        return out

    async def update_weights_from_disk(self, request: Request) -> JSONResponse:
        if not self.config.weight_roots:  # refused here: nothing reaches a worker
            return error_response(403, "forbidden", WEIGHTS_DISABLED)
        body = await self._body(request, UpdateWeightsBody)
        module = checked_module(body.module, self.info.has_transformer_2)
        path = checked_weight_path("path", body.path, self.config.weight_roots)
        return JSONResponse(await self.weights.update(module, path, checksum=body.checksum))

    async def weights_checksum(self, request: Request) -> JSONResponse:
        # Read by hand like the bodies: a bad value is the router's own 400 (documented in MODULE_QUERY).
        module = checked_module(request.query_params.get("module", "transformer"), self.info.has_transformer_2)
        return JSONResponse(await self.weights.checksum(module))

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        # An adapter from memory comes as msgpack with its tensors, so it has its own size limit.
        data = await parse_body(request, self.config.limits.max_lora_bytes)
        if "blob" in data:
            return JSONResponse(await self.loras.load_tensors(LoadLoraTensorsBody.model_validate(data)))
        body = LoadLoraBody.model_validate(data)
        if not self.config.weight_roots:
            return error_response(403, "forbidden", WEIGHTS_DISABLED)
        checked_weight_path("lora_path", body.lora_path, self.config.weight_roots)
        return JSONResponse(await self.loras.load_path(body))

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.loras.unload((await self._body(request, UnloadLoraBody)).lora_name))

    async def lora_adapters(self) -> JSONResponse:
        return JSONResponse(self.loras.adapters())

    # --- weight sync from memory (router/control/weight_sync.py) ------------------------------
    async def weight_sync(self) -> JSONResponse:
        return JSONResponse(self.memory.info())

    async def update_weights_from_tensors(self, request: Request) -> JSONResponse:
        self.memory.check_enabled()  # refused before the body is read
        body = await self._large_body(request, UpdateWeightsFromTensorsBody)
        return JSONResponse(await self.memory.from_tensors(self._module_checked(body)))

    async def init_weights_group(self, request: Request) -> JSONResponse:
        self.memory.check_enabled()
        return JSONResponse(await self.memory.init_group(await self._body(request, InitWeightsGroupBody)))

    async def update_weights_from_distributed(self, request: Request) -> JSONResponse:
        self.memory.check_enabled()
        body = await self._large_body(request, UpdateWeightsFromDistributedBody)
        return JSONResponse(await self.memory.from_distributed(self._module_checked(body)))

    async def destroy_weights_group(self) -> JSONResponse:
        self.memory.check_enabled()
        return JSONResponse(await self.memory.destroy_group())

    async def _large_body(self, request: Request, schema):
        """A weight update's description: one entry per tensor, so it may exceed the usual body limit."""
        return schema.model_validate(await parse_body(request, self.config.limits.max_lora_bytes))

    def _module_checked(self, body):
        checked_module(body.module, self.info.has_transformer_2)
        return body

    async def _body(self, request: Request, schema):
        """The request body as ``schema``; a bad one becomes a 400 naming the field."""
        return schema.model_validate(await parse_body(request, self.config.limits.max_body_bytes))

    async def submit(self, params, rid: str, timeout_s: float | None, images: dict | None = None):
        """Run one admitted request (``images``: its pixels, image-to-video); its answer (and its metrics)."""
        t0 = time.perf_counter()
        outcome = await self.dispatcher.submit(params, rid, timeout_s, versions=lambda: self._versions(params),
                                               images=images)
        self.metrics.generated(outcome.timings, outcome.info, params.n,
                               outcome.info.get("steps_done", params.num_inference_steps), time.perf_counter() - t0)
        return outcome

    def _versions(self, params) -> tuple:
        """What a rollout's answer belongs to: the weight version, and its adapter's version."""
        return self.weights.version, self.loras.table.get(params.lora_name, {}).get("lora_version")

    def params_for(self, body: GenerateBody):
        """The request's parameters, every check done (a bad field raises :class:`FieldError`)."""
        check_family_fields(body, self.info.family)
        check_model_fields(body, self.info)
        check_image_fields(body, self.info)
        if body.guidance_scale_2 is not None and self.info.boundary_ratio is None:
            raise FieldError("guidance_scale_2", "only two-expert models (with boundary_ratio) take it")
        self.loras.check_name(body.lora_name)
        params = to_params(body, self.info.defaults, self.config.limits, self.info.num_train_timesteps,
                           self.info.family, self.config.cache)
        if params.cache is not None:
            problem = cache_problem(params.cache.method, self.info.family, self.config.workers, self.info)
            if problem:
                raise FieldError("cache.method", problem)
        return params

    async def _run_samples(self, body: GenerateBody, request: Request) -> Response:
        rid = request_id_of(request)
        accept = request.headers.get("accept", "")
        if "output_type" not in body.model_fields_set:  # an Accept for a file chooses it; the field wins
            for kind, media_type in MEDIA_TYPES.items():
                if media_type in accept:
                    body = body.model_copy(update={"output_type": kind})
        params = self.params_for(body)
        images = await self.images_of(body)
        t0 = time.perf_counter()
        with self.in_flight.claim(rid):
            self.dispatcher.admit(params.n)
            outcome = await self.cancels.run(rid, self.submit(params, rid, body.timeout_s, images), request,
                                             partial=getattr(body, "return_partial", False))  # n samples, one unit
        steps_done = outcome.info.get("steps_done")
        if body.output_type in MEDIA_TYPES and steps_done is None:  # a partial answer holds latents: JSON
            bare = params.n == 1 and params.rollout is None  # a rollout's log-probs need the JSON answer
            return await asyncio.to_thread(media_response, rid, params.seed, outcome, params.n, body.output_type,
                                           self.info.fps, time.perf_counter() - t0, request, bare)
        payload = samples_payload(rid, params.seed, outcome, params.n, time.perf_counter() - t0,
                                  wants_msgpack(request))
        if steps_done is not None:  # a rollout aborted with return_partial: the steps it took
            payload.update(partial=True, steps_done=steps_done)
        return encode_response(payload, request)

    async def abort_request(self, request: Request) -> JSONResponse:
        return await self.cancels.endpoint(request, self.config.limits.max_body_bytes)


SAMPLES = ("samples (tensors as {dtype, shape, data}; raw bytes with Accept: application/msgpack), timings, "
           "peak_memory (bytes by stage)")


def add_routes(app: FastAPI, routes: Routes) -> None:
    app.add_api_route("/health", routes.health, methods=["GET"], summary="Workers and their states",
                      responses={**ok(answers.Health, "every worker is ready"),
                                 503: {"model": answers.Health, "description": "not every worker is ready "
                                       "(starting, loading, lost): the same body, ok false"}})
    app.add_api_route("/generate", routes.generate, methods=["POST"], summary="Generate videos (or images)",
                      openapi_extra={**request_body(GenerateBody), "parameters": [REQUEST_ID_PARAMETER]},
                      responses={**ok(answers.Samples, SAMPLES, msgpack=True, media=MEDIA_TYPES.values()),
                                 **errors(400, 401, 409, 413, 429, 499, 500, 503, 504)})
    app.add_api_route("/rollout/generate", routes.rollout_generate, methods=["POST"],
                      summary="Generate with SDE log-probs (and trajectories) for RL",
                      openapi_extra={**request_body(RolloutBody), "parameters": [REQUEST_ID_PARAMETER]},
                      responses={**ok(answers.Samples, SAMPLES, msgpack=True, media=MEDIA_TYPES.values()),
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
    app.add_api_route("/abort_request", routes.abort_request, methods=["POST"],
                      summary="Cancel a request in flight by its X-Request-Id (rid), or every one (abort_all, admin)",
                      openapi_extra=request_body(AbortBody),
                      responses={**ok(answers.Aborted, "the ids of the requests cancelled"),
                                 **errors(400, 401, 403, 404, 413)})
    app.add_api_route("/progress/{request_id}", routes.in_flight.endpoint, methods=["GET"],
                      summary="Where a request sent with X-Request-Id is: stage, denoising step, 0-100",
                      openapi_extra=REQUEST_ID_PATH, responses={**ok(answers.Progress), **errors(401, 404)})
    add_lora_routes(app, routes)
    add_weight_sync_routes(app, routes)
    add_sleep_routes(app, SleepRoutes(routes.sleep, routes.config.limits.max_body_bytes))


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


def _lifespan(dispatcher: Dispatcher, api: OpenAIRoutes):
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await dispatcher.start()
        api.jobs.start(api.rerun)  # the video jobs an earlier start left unfinished run again
        yield
        await api.jobs.stop()  # first: a job the stop interrupts stays unfinished, not failed
        await dispatcher.stop()

    return lifespan


def create_app(config: EngineConfig, dispatcher: Dispatcher, *, info: ModelInfo | None = None,
               api_key: str | None = None, admin_key: str | None = None, store: JobStore | None = None) -> FastAPI:
    """The router app over ``dispatcher``, which it starts and stops with itself.

    ``info``: the model's facts (default: read from ``config.model``). ``api_key`` /
    ``admin_key``: see :mod:`router.api.auth` (never part of ``config``). ``store``: the jobs' data dir, open
    and locked (default: ``config.limits.data_dir``'s, opened here).
    """
    routes = Routes(config, dispatcher, info or read_model(config.model))
    api = OpenAIRoutes(routes, store or JobStore(config.limits.data_dir))
    # /docs from the package's own Swagger UI files (router/api/web.py), not a CDN; no ReDoc (a CDN's too).
    app = FastAPI(title="disagg-diffusion", lifespan=_lifespan(dispatcher, api), docs_url=None, redoc_url=None)
    app.add_middleware(RequestMetrics, metrics=routes.metrics)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_key=admin_key)
    app.add_middleware(ReadBodyFirst)  # outermost: every early answer (413, 401, 404, ...) reads the body first
    install_error_handlers(app)
    app.add_exception_handler(ClientDisconnect, client_gone_mid_body)  # one log line, no traceback
    add_routes(app, routes)
    add_openai_routes(app, api)
    add_web_routes(app)  # the page at / and /docs
    registry = dispatcher.registry
    routes.metrics.watch(EngineState(
        workers=lambda: dispatcher.health()[1], jobs=api.jobs.counts, weights=lambda: routes.weights.version,
        adapters=lambda: {n: a["lora_version"] for n, a in routes.loras.table.items()},
        restarts=lambda: {key: len(w.dead_pids) for key, w in registry.workers.items()},
        shm=dispatcher.shm.counts))
    app.add_api_route("/metrics", lambda: routes.metrics.exposition(), methods=["GET"],
                      summary="Prometheus metrics (text exposition format)", response_class=Response,
                      responses={**ok(None, "the text exposition format", media=["text/plain"]), **errors(401)})
    app.openapi = engine_openapi(app, body_facts(config, routes.info))  # this engine's limits in the schema
    return app
