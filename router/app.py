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

from common.config import EngineConfig
from common.http_tensors import tensor_to_body
from common.model import ModelInfo
from router.dispatcher import Dispatcher, EngineError
from router.schemas import FieldError, GenerateBody, to_params

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


async def _parse_body(request: Request) -> dict:
    raw = await request.body()
    ctype = request.headers.get("content-type", "")
    try:
        data = msgpack.unpackb(raw, raw=False) if MSGPACK in ctype else json.loads(raw or b"null")
    except Exception as e:
        raise FieldError("body", f"not valid {'msgpack' if MSGPACK in ctype else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise FieldError("body", "must be a JSON object")
    return data


def create_app(config: EngineConfig) -> FastAPI:
    dispatcher = Dispatcher(config)
    info = ModelInfo.read(config.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await dispatcher.start()
        yield
        await dispatcher.stop()

    app = FastAPI(title="disagg-diffusion", lifespan=lifespan)
    app.state.dispatcher = dispatcher

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, e: EngineError):
        return error_response(e.status, e.type, e.message, e.stage, e.request_id or None)

    @app.exception_handler(FieldError)
    async def _field_error(request: Request, e: FieldError):
        return error_response(400, "invalid_request", str(e), field=e.field)

    @app.get("/health")
    async def health():
        ok, workers = dispatcher.health()
        return JSONResponse({"ok": ok, "model": str(info.path), "workers": workers}, status_code=200 if ok else 503)

    @app.post("/generate")
    async def generate(request: Request):
        data = await _parse_body(request)
        try:
            body = GenerateBody.model_validate(data)
        except ValidationError as e:
            return _validation_error(e)
        params = to_params(body, info.defaults, config.limits)
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        seeds = [body.seed + i for i in range(body.n)]
        subs = [msgspec.structs.replace(params, seed=s) for s in seeds]
        ids = [rid if body.n == 1 else f"{rid}-{i}" for i in range(body.n)]
        outcomes = await asyncio.gather(*(dispatcher.submit(p, i) for p, i in zip(subs, ids)))
        binary = MSGPACK in request.headers.get("accept", "")
        timings = {k: sum(o.timings.get(k, 0.0) for o in outcomes) for k in ("encode_s", "denoise_s", "decode_s")}
        timings["total_s"] = time.perf_counter() - t0
        payload = {
            "request_id": rid,
            "samples": [
                {"seed": s, "output": tensor_to_body(o.output, binary), "route": msgspec.structs.asdict(o.route)}
                for s, o in zip(seeds, outcomes)
            ],
            "timings": timings,
        }
        return _encode(payload, request)

    return app
