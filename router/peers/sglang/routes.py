"""SGLang diffusion's post-training routes over the engine.

Every route is served under ``/sglang`` (a client's base URL ``http://HOST:PORT/sglang``). At the root the routes
whose names the native API does not use are SGLang's too (``/health_generate``, ``/get_weights_checksum``,
``/update_weights_from_tensor``, the ``*_weights_update_group`` pair); ``/rollout/generate``,
``/update_weights_from_disk`` and ``/update_weights_from_distributed`` are SGLang's for a body in SGLang's shape
(router/peers/sglang/translate.py); the release / resume pair, whose bodies look alike, with ``--peer-api sglang``.

The control routes answer SGLang's ``{"success", "message"}`` (a failure with its HTTP status, the engine's
``error`` object beside, naming the field); ``/rollout/generate`` answers SGLang's msgpack list.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from common.protocol.codec import DTYPES
from common.protocol.messages import EXPERT_NAMES
from router.api.bodies import MSGPACK, decode_body, parse_body, read_limited
from router.api.cancel_api import gone_of
from router.api.http_errors import first_error
from router.api.request_ids import request_id_of
from router.request.schemas import InitWeightsGroupBody, RolloutBody, UpdateWeightsFromDistributedBody
from router.core.engine import Engine
from router.core.errors import EngineError, FieldError
from router.api.openapi import errors, ok, request_body
from router.peers.sglang import answer, answers
from router.peers.sglang.schemas import (
    DestroyWeightsUpdateGroup, GetWeightsChecksum, InitWeightsUpdateGroup, RolloutRequest, UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
)
from router.peers.sglang.translate import native_body, sglang_field
from router.peers.vllm_omni.control import weights_checksum as vllm_omni_checksum
from router.peers.vllm_omni.routes import speaks_vllm_omni_checksum

PREFIX = "/sglang"
NOT_FOUND = "not_found"  # SGLang's checksum of a module its pipeline lacks


def _error(e: EngineError, field: str | None = None) -> JSONResponse:
    """A failure as SGLang's clients read it (``success``, ``message``; ``detail`` as its HTTPExceptions) with
    the engine's error object beside."""
    field = field if field is not None else e.field
    err = {"type": e.type, "message": e.message, "request_id": e.request_id or None, "stage": e.stage}
    if field is not None:
        err["field"] = field
    return JSONResponse({"success": False, "message": e.message, "detail": e.message, "error": err},
                        status_code=e.status, headers=e.headers)


def _invalid(e: ValidationError, rename=lambda f: f) -> JSONResponse:
    field, message = first_error(e.errors())
    return _error(FieldError(rename(field), message.split(": ", 1)[-1]))


class SGLangRoutes:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.limits = engine.config.limits
        self.group_name: str | None = None  # the weights group SGLang's trainer named at init

    async def _body(self, request: Request, schema, limit: int | None = None):
        """The body (an empty one: every default) as ``schema``; a bad one raises ValidationError."""
        raw = await read_limited(request, limit or self.limits.max_body_bytes)
        return schema.model_validate(decode_body(raw, request) if raw else {})

    # --- rollouts ---------------------------------------------------------------------------------------
    async def rollout_generate(self, request: Request) -> Response:
        return await self.rollout(await parse_body(request, self.engine.sample_body_limit(True)), request)

    async def rollout(self, data: dict, request: Request) -> Response:
        """A rollout in SGLang's body; its answer in SGLang's msgpack list."""
        engine, rid = self.engine, request_id_of(request)
        try:
            req = RolloutRequest.model_validate(data)
        except ValidationError as e:
            return _invalid(e)
        try:
            native, plan = native_body(req, engine.info, engine.config.image_roots, self.limits.max_image_bytes, data)
        except FieldError as e:
            return _error(e)
        try:
            body = RolloutBody.model_validate(native)
        except ValidationError as e:
            return _invalid(e, sglang_field)
        try:
            done = await engine.generate(body, rid, gone_of(request))
        except FieldError as e:
            return _error(e, sglang_field(e.field, engine.info))
        except EngineError as e:
            return _error(e)
        payload = answer.samples(rid, req.prompt, plan, done.outcome, done.params.n,
                                 time.perf_counter() - done.started, engine.config.sglang_tensors == "base64")
        return Response(answer.encode(payload), media_type=MSGPACK, headers={"X-Request-Id": rid})

    # --- health -----------------------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        """SGLang's ``/health`` (and ``/health_generate``, the same): ``{"status": "ok"}`` once every worker is
        ready, else 503."""
        health = self.engine.health()
        if health["ok"]:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "error": {
            "type": "not_ready", "message": "not every worker is ready", "request_id": None, "stage": "router"}},
            status_code=503)

    # --- weights ----------------------------------------------------------------------------------------
    def _experts(self) -> list[str]:
        return list(EXPERT_NAMES if self.engine.info.has_transformer_2 else EXPERT_NAMES[:1])

    def _components(self) -> set[str]:
        """The pipeline's components (model_index.json), as SGLang lists its modules."""
        return set(self.engine.info.index) - {n for n in self.engine.info.index if n.startswith("_")}

    def _targets(self, asked: list[str] | None) -> list[str]:
        """The experts ``target_modules`` names (none: all): SGLang's error for a name the pipeline lacks; the
        text encoders and the VAE are not updated by this engine."""
        experts = self._experts()
        if asked is None:
            return experts
        unknown = [m for m in asked if m not in self._components()]
        if unknown:
            raise FieldError("target_modules", f"Module(s) requested for update not found in pipeline: {unknown}. "
                                               f"Available Module(s): {sorted(self._components())}")
        frozen = [m for m in asked if m not in experts]
        if frozen:
            raise FieldError("target_modules", f"{frozen}: this engine updates the transformer experts only "
                                               f"({experts})")
        return list(dict.fromkeys(asked))

    async def update_weights_from_disk(self, request: Request) -> JSONResponse:
        raw = await read_limited(request, self.limits.max_body_bytes)
        return await self.update_weights_from_disk_body(decode_body(raw, request) if raw else {})

    async def update_weights_from_disk_body(self, data: dict) -> JSONResponse:
        """Each expert from ``model_path/<expert>`` (a diffusers folder), all of them checked first."""
        if not data.get("model_path"):  # SGLang's own check and message
            return _error(EngineError(400, "invalid_request", "model_path is required", "router", "",
                                      field="model_path"))
        try:
            body = UpdateWeightsFromDisk.model_validate(data)
        except ValidationError as e:
            return _invalid(e)
        try:
            self.engine.check_weights_enabled()
            targets = self._targets(body.target_modules)
            missing = [m for m in targets if not any((Path(body.model_path) / m).glob("*.safetensors"))]
            if missing:
                raise FieldError("model_path", f"Cannot update weights: missing weight files for modules: {missing}. "
                                               "No partial updates allowed.")
            done = [await self.engine.update_weights_from_disk(m, str(Path(body.model_path) / m), checksum=False)
                    for m in targets]
        except EngineError as e:
            return _error(e, "model_path" if e.field == "path" else None)
        return JSONResponse({"success": True, "message": f"Updated {len(done)} modules ({', '.join(targets)}).",
                             "weight_version": done[-1]["weight_version"]})

    async def get_weights_checksum(self, request: Request) -> JSONResponse:
        """SGLang's digest per module (router/control/weights.py, scheme sglang): the experts by default;
        ``not_found`` for a module the denoise workers do not hold."""
        raw = await read_limited(request, self.limits.max_body_bytes)
        data = decode_body(raw, request) if raw else {}
        if speaks_vllm_omni_checksum(data):  # vLLM-Omni's body (router/peers/vllm_omni/)
            return await vllm_omni_checksum(self.engine, data)
        try:
            body = GetWeightsChecksum.model_validate(data)
        except ValidationError as e:
            return _invalid(e)
        names = body.module_names if body.module_names is not None else self._experts()
        out = {}
        try:
            for name in names:
                out[name] = ((await self.engine.weights.checksum(name, "sglang"))["sha256"]
                             if name in self._experts() else NOT_FOUND)
        except EngineError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        return JSONResponse(out)

    async def update_weights_from_tensor(self, request: Request) -> JSONResponse:
        """SGLang's tensors arrive pickled (torch's multiprocessing reductions of CUDA IPC handles): refused
        unread, with the route that carries the same tensors safely."""
        await request.body()
        return _error(FieldError("serialized_named_tensors", "pickled payloads are refused (no pickle reaches "
                                 "this engine): send the tensors with router.peers.sglang.sender.SGLangWeightSender (shared memory "
                                 "or CUDA IPC through /update_weights_from_tensors, docs/api.md#sglang-diffusion)"))

    # --- the weights group --------------------------------------------------------------------------------
    async def init_weights_update_group(self, request: Request) -> JSONResponse:
        engine = self.engine
        try:
            engine.check_memory_sync_enabled()
            body = await self._body(request, InitWeightsUpdateGroup)
        except ValidationError as e:
            return _invalid(e)
        except EngineError as e:
            return _error(e)
        world = 1 + len(engine.config.of_role("denoise"))
        try:
            if body.world_size != world:
                raise FieldError("world_size", f"must be {world}: the trainer (rank 0) and this engine's "
                                               f"{world - 1} denoise worker(s)")
            if body.rank_offset != 1:
                raise FieldError("rank_offset", "must be 1: the trainer is rank 0, the denoise workers 1..")
            await engine.init_weights_group(InitWeightsGroupBody(master_address=body.master_address,
                                                                 master_port=body.master_port, backend=body.backend))
        except EngineError as e:
            return _error(e)
        self.group_name = body.group_name
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    def _check_group(self, name: str) -> None:
        if self.group_name is None:
            raise FieldError("group_name", "no weights group: POST /init_weights_update_group first")
        if name != self.group_name:
            raise FieldError("group_name", f"the engine's group is {self.group_name!r}, got {name!r}")

    async def update_weights_from_distributed(self, request: Request) -> JSONResponse:
        try:
            self.engine.check_memory_sync_enabled()
        except EngineError as e:
            return _error(e)
        raw = await read_limited(request, self.limits.max_lora_bytes)
        return await self.update_weights_from_distributed_body(decode_body(raw, request) if raw else {})

    async def update_weights_from_distributed_body(self, data: dict) -> JSONResponse:
        """One broadcast per tensor, in its dtype, as SGLang's trainers send them; the engine's own layout
        holds each tensor in a bucket of its own."""
        try:
            body = UpdateWeightsFromDistributed.model_validate(data)
        except ValidationError as e:
            return _invalid(e)
        try:
            self._check_group(body.group_name)
            module = self._targets(body.target_modules)[0] if body.target_modules else "transformer"
            if not len(body.names) == len(body.dtypes) == len(body.shapes):
                raise FieldError("names", "names, dtypes and shapes must be as long as each other")
            tensors, buckets = [], []
            for i, (name, dtype, shape) in enumerate(zip(body.names, body.dtypes, body.shapes)):
                dtype = dtype.removeprefix("torch.")
                if dtype not in DTYPES:
                    raise FieldError(f"dtypes.{i}", f"unknown dtype {dtype!r}")
                numel = 1
                for d in shape:
                    numel *= d
                tensors.append({"name": name, "dtype": dtype, "shape": shape, "bucket": i, "offset": 0})
                buckets.append({"nbytes": numel * DTYPES[dtype].itemsize})
            native = UpdateWeightsFromDistributedBody(module=module, checksum=False, tensors=tensors, buckets=buckets)
            done = await self.engine.update_weights_from_distributed(native, typed=True)
        except ValidationError as e:
            return _invalid(e)
        except EngineError as e:
            return _error(e)
        return JSONResponse({"success": True, "message": "Succeeded to update parameter online.",
                             "weight_version": done["weight_version"]})

    async def destroy_weights_update_group(self, request: Request) -> JSONResponse:
        try:
            body = await self._body(request, DestroyWeightsUpdateGroup)
            self._check_group(body.group_name)
            await self.engine.destroy_weights_group()
        except ValidationError as e:
            return _invalid(e)
        except EngineError as e:
            return _error(e)
        self.group_name = None
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    # --- memory -------------------------------------------------------------------------------------------
    async def release_memory_occupation(self, request: Request) -> JSONResponse:
        """SGLang's release: every component's weights to host memory (level 1), kept for the resume."""
        await request.body()
        if self.engine.sleep_state()["is_sleeping"]:
            return JSONResponse({"success": True, "sleeping": True, "message": "already sleeping"})
        try:
            await self.engine.release_memory(None, level=1)
        except EngineError as e:
            return _error(e)
        return JSONResponse({"success": True, "sleeping": True,
                             "message": "released GPU memory (moved active modules to CPU)"})

    async def resume_memory_occupation(self, request: Request) -> JSONResponse:
        await request.body()
        if not self.engine.sleep_state()["is_sleeping"]:
            return JSONResponse({"success": True, "sleeping": False, "message": "already awake"})
        try:
            await self.engine.resume_memory(None)
        except EngineError as e:
            return _error(e)
        return JSONResponse({"success": True, "sleeping": False,
                             "message": "resumed GPU memory (restored modules to original devices)"})


def add_sglang_routes(app: FastAPI, routes: SGLangRoutes, root_memory: bool) -> None:
    """Every route under ``/sglang``; at the root those the native API leaves free (``root_memory``: the
    release / resume pair too, ``--peer-api sglang``)."""
    bodies = {"/update_weights_from_disk": UpdateWeightsFromDisk, "/get_weights_checksum": GetWeightsChecksum,
              "/init_weights_update_group": InitWeightsUpdateGroup,
              "/update_weights_from_distributed": UpdateWeightsFromDistributed,
              "/destroy_weights_update_group": DestroyWeightsUpdateGroup}
    post = {"/rollout/generate": (routes.rollout_generate, ok(None, "a msgpack list, a map per sample "
                                                             "(RolloutSample)", media=[MSGPACK])),
            "/update_weights_from_disk": (routes.update_weights_from_disk, ok(answers.Done)),
            "/get_weights_checksum": (routes.get_weights_checksum, ok(answers.Checksums)),
            "/update_weights_from_tensor": (routes.update_weights_from_tensor, ok(answers.Done, "never: pickled "
                                                                                 "payloads are refused (400)")),
            "/init_weights_update_group": (routes.init_weights_update_group, ok(answers.Done)),
            "/update_weights_from_distributed": (routes.update_weights_from_distributed, ok(answers.Done)),
            "/destroy_weights_update_group": (routes.destroy_weights_update_group, ok(answers.Done)),
            "/release_memory_occupation": (routes.release_memory_occupation, ok(answers.Memory)),
            "/resume_memory_occupation": (routes.resume_memory_occupation, ok(answers.Memory))}
    tags, failures = ["SGLang diffusion"], errors(400, 401, 403, 409, 413, 429, 499, 500, 503, 504)

    def add(path: str, prefix: str) -> None:
        handler, answer = post[path]
        extra = request_body(RolloutRequest if path == "/rollout/generate" else bodies[path]) \
            if path in bodies or path == "/rollout/generate" else None
        app.add_api_route(prefix + path, handler, methods=["POST"], tags=tags, summary=f"SGLang's {path}",
                          openapi_extra=extra, responses={**answer, **failures},
                          **({"response_class": Response} if path == "/rollout/generate" else {}))

    for path in post:
        add(path, PREFIX)
    free = ["/get_weights_checksum", "/update_weights_from_tensor", "/init_weights_update_group",
            "/destroy_weights_update_group"]
    for path in free + (["/release_memory_occupation", "/resume_memory_occupation"] if root_memory else []):
        add(path, "")
    health = {**ok(answers.Health, "every worker is ready"), **errors(400, 401, 500, 503)}
    for path in (PREFIX + "/health", PREFIX + "/health_generate", "/health_generate"):
        app.add_api_route(path, routes.health, methods=["GET"], tags=tags, summary="SGLang's health",
                          responses=health)
