"""The sleep endpoints over the engine (router/control/sleep.py does the work): SGLang's
``/release_memory_occupation`` and ``/resume_memory_occupation`` (JSON bodies), vLLM's ``/sleep``, ``/wake_up``
and ``/is_sleeping`` (query parameters only)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from router.api.bodies import decode_body, read_limited
from router.api import answers
from router.api.openapi import errors, ok, request_body
from router.request.schemas import ReleaseMemoryBody, ResumeMemoryBody
from router.core.engine import Engine
from router.core.errors import FieldError
from router.peers.vllm_omni import control as vllm_omni

LEVELS = {"1": 1, "2": 2}
MODES = ("wait", "abort")


class SleepRoutes:
    def __init__(self, engine: Engine):
        self.engine, self.body_limit = engine, engine.config.limits.max_body_bytes

    async def _body(self, request: Request, schema):
        """An empty body means every default (SGLang's client may send none)."""
        raw = await read_limited(request, self.body_limit)
        return schema.model_validate(decode_body(raw, request)) if raw else schema()

    async def release(self, request: Request) -> JSONResponse:
        body = await self._body(request, ReleaseMemoryBody)
        return JSONResponse(await self.engine.release_memory(body.tags, body.level, body.mode))

    async def resume(self, request: Request) -> JSONResponse:
        body = await self._body(request, ResumeMemoryBody)
        return JSONResponse(await self.engine.resume_memory(body.tags, body.reload))

    async def _query(self, request: Request, allowed: tuple[str, ...]) -> None:
        """vLLM's spellings: query parameters only, each known."""
        if await read_limited(request, self.body_limit):
            raise FieldError("body", f"{request.url.path} takes query parameters only ({', '.join(allowed)}), no body")
        for name in request.query_params:
            if name not in allowed:
                raise FieldError(name, f"unknown query parameter; {request.url.path} takes {', '.join(allowed)}")

    async def sleep(self, request: Request) -> JSONResponse:
        if "stage_ids" in request.query_params:  # vLLM-Omni's (router/peers/vllm_omni/)
            return await vllm_omni.sleep(self.engine, request)
        await self._query(request, ("level", "mode"))
        q = request.query_params
        level = LEVELS.get(q.get("level", "1"))
        if level is None:
            raise FieldError("level", f"must be 1 or 2, got {q.get('level')!r}")
        mode = q.get("mode", "wait")
        if mode not in MODES:
            raise FieldError("mode", f"must be wait or abort, got {mode!r}")
        return JSONResponse(await self.engine.release_memory(None, level, mode))

    async def wake_up(self, request: Request) -> JSONResponse:
        if "stage_ids" in request.query_params:  # vLLM-Omni's (router/peers/vllm_omni/)
            return await vllm_omni.wake_up(self.engine, request)
        await self._query(request, ("tags",))
        tags = request.query_params.getlist("tags")
        return JSONResponse(await self.engine.resume_memory(tags or None))

    async def is_sleeping(self, request: Request) -> JSONResponse:
        await self._query(request, ())
        return JSONResponse(self.engine.sleep_state())


QUERY = {
    "/sleep": [{"name": "level", "in": "query", "required": False, "schema": {"type": "integer", "enum": [1, 2],
                "default": 1}, "description": "1: weights to host memory; 2: dropped"},
               {"name": "mode", "in": "query", "required": False,
                "schema": {"type": "string", "enum": list(MODES), "default": "wait"}}],
    "/wake_up": [{"name": "tags", "in": "query", "required": False, "description": "repeatable; none: all",
                  "schema": {"type": "array", "items": {"type": "string"}}}],
}


def add_sleep_routes(app: FastAPI, routes: SleepRoutes) -> None:
    slept = "the components' states after it (is_sleeping, components), each worker's released bytes"
    app.add_api_route("/release_memory_occupation", routes.release, methods=["POST"],
                      summary="Release the weights of the tagged components (a colocated trainer's turn)",
                      openapi_extra=request_body(ReleaseMemoryBody),
                      responses={**ok(answers.Released, slept), **errors(400, 401, 403, 413, 500, 504)})
    app.add_api_route("/resume_memory_occupation", routes.resume, methods=["POST"],
                      summary="Resume the tagged components' weights (409 weights_missing: push them or reload)",
                      openapi_extra=request_body(ResumeMemoryBody),
                      responses={**ok(answers.Resumed, slept), **errors(400, 401, 403, 409, 413, 500, 504)})
    app.add_api_route("/sleep", routes.sleep, methods=["POST"], summary="vLLM's spelling: release every component",
                      openapi_extra={"parameters": QUERY["/sleep"]},
                      responses={**ok(answers.Released, slept), **errors(400, 401, 403, 500, 504)})
    app.add_api_route("/wake_up", routes.wake_up, methods=["POST"], summary="vLLM's spelling: resume components",
                      openapi_extra={"parameters": QUERY["/wake_up"]},
                      responses={**ok(answers.Resumed, slept), **errors(400, 401, 403, 409, 500, 504)})
    app.add_api_route("/is_sleeping", routes.is_sleeping, methods=["GET"],
                      summary="Whether any component sleeps, and each one's state",
                      responses={**ok(answers.SleepState), **errors(400, 401)})
