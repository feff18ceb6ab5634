"""The HTTP front door: FastAPI routes over the :class:`Dispatcher`."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

import msgpack
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from common.config.engine import EngineConfig
from common.protocol.http_tensors import tensor_to_body
from common.wan.model_info import ModelInfo
from router.auth import ApiKeyMiddleware
from router.dispatcher import Dispatcher, EngineError
from router.schemas import FieldError, GenerateBody, RolloutBody, UpdateWeightsBody, to_params

MSGPACK = "application/msgpack"


def error_response(status: int, type_: str, message: str, stage: str = "router", request_id=None, field=None):
    err = {"type": type_, "message": message, "request_id": request_id, "stage": stage}
    if field is not None:
        err["field"] = field
    return JSONResponse({"error": err}, status_code=status)


def _validation_error(e: ValidationError) -> JSONResponse:
    first = e.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ())) or "body"
    return error_response(400, "invalid_request", f"{field}: {first.get('msg')}", field=field)


def _encode(payload: dict, request: Request) -> Response:
    if MSGPACK in request.headers.get("accept", ""):
        return Response(msgpack.packb(payload, use_bin_type=True), media_type=MSGPACK)
    return Response(json.dumps(payload), media_type="application/json")


class BodyTooLarge(Exception):
    pass


async def _read_limited(request: Request, limit: int) -> bytes:
    """The body, refused before parsing once it is known (or seen) to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse_body(request: Request, limit: int) -> dict:
    raw = await _read_limited(request, limit)
    ctype = request.headers.get("content-type", "")
    try:
        data = msgpack.unpackb(raw, raw=False) if MSGPACK in ctype else json.loads(raw or b"null")
    except Exception as e:
        raise FieldError("body", f"not valid {'msgpack' if MSGPACK in ctype else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise FieldError("body", "must be a JSON object")
    return data


def _sample_body(seed: int, o, binary: bool) -> dict:
    t = o.tensors
    body = {
        "seed": seed,
        "output": tensor_to_body(t["output"], binary),
        "route": msgspec.structs.asdict(o.route),
        "weight_version": o.info.get("weight_version"),
    }
    if "scheduler" in o.info:
        body["scheduler"] = o.info["scheduler"]
    if "batch" in o.info:
        body["batch"] = o.info["batch"]  # the most requests this sample shared a denoise forward with
    if "log_probs" in t:
        body["log_probs"] = tensor_to_body(t["log_probs"], binary)
        body["log_prob_steps"] = tensor_to_body(t["log_prob_steps"], binary)
    if "trajectory.latents" in t:
        body["trajectory"] = {k: tensor_to_body(t[f"trajectory.{k}"], binary) for k in ("latents", "timesteps", "sigmas")}
    return body


def create_app(config: EngineConfig, *, api_key: str | None = None, admin_key: str | None = None) -> FastAPI:
    """The router app. ``api_key`` / ``admin_key``: see :mod:`router.auth` (never part of ``config``)."""
    dispatcher = Dispatcher(config)
    info = ModelInfo.read(config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await dispatcher.start()
        yield
        await dispatcher.stop()

    app = FastAPI(title="disagg-diffusion", lifespan=lifespan)
    app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_key=admin_key)
    weights_lock = asyncio.Lock()  # one weight update at a time
    app.state.dispatcher = dispatcher

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError):
        resp = error_response(e.status, e.type, e.message, e.stage, e.request_id or None)
        resp.headers.update(e.headers)
        return resp

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, e: BodyTooLarge):
        limit = config.limits.max_body_bytes
        return error_response(413, "body_too_large", f"request body exceeds {limit} bytes", field="body")

    @app.exception_handler(ValidationError)
    async def _invalid(request: Request, e: ValidationError):
        return _validation_error(e)

    @app.exception_handler(FieldError)
    async def _field_error(request: Request, e: FieldError):
        return error_response(400, "invalid_request", str(e), field=e.field)

    @app.get("/health")
    async def health():
        ok, workers = dispatcher.health()
        return JSONResponse({"ok": ok, "model": str(info.path), "workers": workers}, status_code=200 if ok else 503)

    async def run_samples(body: GenerateBody, request: Request):
        if body.guidance_scale_2 is not None and info.boundary_ratio is None:
            raise FieldError("guidance_scale_2", "only two-expert models (with boundary_ratio) take it")
        params = to_params(body, info.defaults, config.limits, dispatcher.n_train)
        dispatcher.admit(body.n)
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        seeds = [body.seed + i for i in range(body.n)]
        ids = [rid if body.n == 1 else f"{rid}-{i}" for i in range(body.n)]
        subs = [msgspec.structs.replace(params, seed=s) for s in seeds]
        outcomes = await asyncio.gather(*(dispatcher.submit(p, i, body.timeout_s) for p, i in zip(subs, ids)))
        binary = MSGPACK in request.headers.get("accept", "")
        timings = {k: sum(o.timings.get(k, 0.0) for o in outcomes) for k in ("encode_s", "denoise_s", "decode_s")}
        timings["total_s"] = time.perf_counter() - t0
        samples = [_sample_body(s, o, binary) for s, o in zip(seeds, outcomes)]
        versions = {s["weight_version"] for s in samples}
        payload = {
            "request_id": rid,
            "samples": samples,
            "timings": timings,
            # One version when every sample ran on the same weights; null if an update landed in between.
            "weight_version": versions.pop() if len(versions) == 1 else None,
        }
        return _encode(payload, request)

    async def validated(request: Request, schema):
        """The request body as ``schema``; a bad one becomes a 400 naming the field (handler above)."""
        return schema.model_validate(await _parse_body(request, config.limits.max_body_bytes))

    @app.post("/generate")
    async def generate(request: Request):
        return await run_samples(await validated(request, GenerateBody), request)

    @app.post("/rollout/generate")
    async def rollout_generate(request: Request):
        return await run_samples(await validated(request, RolloutBody), request)

    def _module_checked(module: str) -> str:
        if module == "transformer_2" and not info.has_transformer_2:
            raise FieldError("module", "this model has no transformer_2")
        if module not in ("transformer", "transformer_2"):
            raise FieldError("module", "must be 'transformer' or 'transformer_2'")
        return module

    def _control_failure(replies) -> JSONResponse | None:
        errors = [r for r in replies if isinstance(r, EngineError)]
        if not errors:
            return None
        if len(errors) == len(replies) and all(400 <= e.status < 500 for e in errors):
            e = errors[0]
            return error_response(e.status, e.type, e.message, e.stage)
        detail = "; ".join(f"{e.stage}: {e.message}" for e in errors)
        return error_response(500, "inconsistent_workers", f"{len(errors)}/{len(replies)} workers failed: {detail}",
                              "denoise")

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        if not config.weight_roots:  # refused here: nothing reaches a worker
            return error_response(403, "forbidden",
                                  "weight updates are disabled: start the engine with --weight-root DIR")
        body = await validated(request, UpdateWeightsBody)
        module = _module_checked(body.module)
        async with weights_lock:
            version = dispatcher.weight_version + 1
            t0 = time.perf_counter()
            replies = await dispatcher.control("denoise", "update_weights", module=module, path=body.path,
                                               version=version)
            failure = _control_failure(replies)
            if failure is not None:
                return failure
            dispatcher.weight_version = version
        sums = {r.data["sha256"] for r in replies}
        return JSONResponse({
            "weight_version": version,
            "module": module,
            "sha256": sums.pop() if len(sums) == 1 else None,
            "seconds": time.perf_counter() - t0,
            "workers": [{"index": r.index, **r.data} for r in replies],
        })

    @app.get("/weights_checksum")
    async def weights_checksum(module: str = "transformer"):
        module = _module_checked(module)
        replies = await dispatcher.control("denoise", "checksum", module=module)
        failure = _control_failure(replies)
        if failure is not None:
            return failure
        sums = {r.data["sha256"] for r in replies}
        versions = {r.data["weight_version"] for r in replies}
        consistent = len(sums) == 1 and len(versions) == 1
        return JSONResponse({
            "module": module,
            "sha256": next(iter(sums)) if consistent else None,
            "weight_version": next(iter(versions)) if consistent else None,
            "consistent": consistent,
            "workers": [{"index": r.index, **r.data} for r in replies],
        })

    return app
