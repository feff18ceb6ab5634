"""vLLM-Omni's RL routes over the engine (to be filled in)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from router.core.engine import Engine

PREFIX = "/vllm-omni"


def speaks_vllm_omni(body: dict) -> bool:
    """Whether a ``/rollout/generate`` body is vLLM-Omni's (its own fields)."""
    return any(k in body for k in ("sampling_params", "stage_id", "request_id", "transport"))


class VllmOmniRoutes:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def rollout(self, data: dict, request: Request) -> Response:
        raise NotImplementedError


def add_vllm_omni_routes(app: FastAPI, routes: VllmOmniRoutes) -> None:
    pass
