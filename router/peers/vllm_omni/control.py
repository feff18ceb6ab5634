"""vLLM-Omni's control routes over the engine, as the diffusion stage of vLLM-Omni answers them: the weight
transfer (pause, init, start, N file updates, finish), the checksum, LoRA adapters, sleep and wake by stage.

Each answers ``{"message", "acks"}``, one ack per denoise worker (its ``rank``: the worker's index), all of
stage 0. Query parameters are read by hand: a bad one is a 400 naming it.
"""

from __future__ import annotations

import hashlib
import re
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.request.schemas import LoadLoraBody
from router.core.engine import Engine
from router.core.errors import EngineError, FieldError
from router.core.pause import MODES
from router.peers.vllm_omni.schemas import (
    LoadLoRARequest, OmniSleepRequest, OmniWakeupRequest, UnloadLoRARequest, WeightsChecksumRequest,
)
from router.peers.vllm_omni.translate import STAGE_ID, check_stages

BACKENDS = ("safetensors", "filesystem", "shared_storage")  # a diffusion stage's: files it reads
WHOLE = (None, "", "pipeline", "model")  # the peer's whole pipeline: here the denoiser (its first expert)
NO_TAG = "kv_cache"  # vLLM's KV cache tag: nothing here holds one
INT = re.compile(r"^-?[0-9]{1,18}$")
TRUE, FALSE = ("1", "on", "t", "true", "y", "yes"), ("0", "off", "f", "false", "n", "no")


# --- query parameters ---------------------------------------------------------------------------------------
def int_list(request: Request, name: str) -> list[int] | None:
    values = request.query_params.getlist(name)
    bad = [v for v in values if not INT.match(v)]
    if bad:
        raise FieldError(name, f"must be integers (repeat the key for several), got {bad[0]!r}")
    return [int(v) for v in values] or None


def int_param(request: Request, name: str, default: int | None) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return default
    if not INT.match(value):
        raise FieldError(name, f"must be an integer, got {value!r}")
    return int(value)


def bool_param(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in TRUE + FALSE:
        raise FieldError(name, f"must be true or false, got {value!r}")
    return value.lower() in TRUE


def stage_ids(request: Request) -> list[int] | None:
    ids = int_list(request, "stage_ids")
    check_stages("stage_ids", ids)
    return ids


# --- answers ------------------------------------------------------------------------------------------------
def ack(result: dict) -> dict:
    return {"stage_id": STAGE_ID, "success": True, "result": {"supported": True, **result}}


def acked(message: str, acks: list[dict]) -> JSONResponse:
    return JSONResponse({"message": message, "acks": acks})


def ranks(engine: Engine) -> list[int]:
    return [w.index for w in engine.config.of_role("denoise")]


def component_of(engine: Engine, field: str, component) -> str:
    """The expert a body's ``component`` names (the peer's whole pipeline: the first)."""
    experts = ["transformer", "transformer_2"] if engine.info.has_transformer_2 else ["transformer"]
    if component in WHOLE:
        return experts[0]
    if component not in experts:
        raise FieldError(field, f"{component!r}: this engine's diffusion stage updates and checksums the "
                                f"denoiser's experts ({', '.join(experts)}); the text encoders and the VAE stay")
    return component


def stable_lora_int_id(lora_path: str) -> int:
    """vLLM-Omni's id of an adapter: from its path."""
    digest = hashlib.sha256(lora_path.encode("utf-8")).digest()
    return (int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)) or 1


def out_of_order(message: str) -> EngineError:
    """A call out of the sequence (the peer's RuntimeError: 400)."""
    return EngineError(400, "out_of_order", message, "router", "")


# --- the weight transfer -------------------------------------------------------------------------------------
class WeightTransfer:
    """One transaction at a time: ``init`` names its target, ``start`` (paused) opens it, each ``update``
    loads one file (a new weight version each), ``finish`` closes it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.target: dict | None = None  # init's stage_ids, component, backend
        self.active = False

    def init(self, info: dict) -> JSONResponse:
        ids = info.get("stage_ids")
        if ids is not None and (not isinstance(ids, list) or not all(type(i) is int for i in ids)):
            raise FieldError("init_info.stage_ids", f"must be a list of integers, got {ids!r}")
        check_stages("init_info.stage_ids", ids)
        component = component_of(self.engine, "init_info.component", info.get("component"))
        backend = info.get("backend", info.get("type", "safetensors"))
        if backend not in BACKENDS:
            raise FieldError("init_info.backend", f"{backend!r}: this engine's diffusion stage reads weight files "
                             f"({', '.join(BACKENDS)}), as vLLM-Omni's diffusion stages do. Tensors over NCCL or "
                             "gloo: this engine's POST /init_weights_group (or SGLang's /init_weights_update_group); "
                             "from the trainer's memory: POST /update_weights_from_tensors")
        if not self.engine.config.weight_roots:
            raise EngineError(403, "forbidden", "weight updates are disabled: start the engine with --weight-root DIR "
                              "(the files update_weights names lie below it)", "router", "", field="init_info")
        if self.active:
            raise out_of_order("a weight update is active: POST /finish_weight_update first")
        self.target = {"stage_ids": ids, "component": info.get("component"), "module": component, "backend": backend}
        return acked("Weight transfer initialized", [ack({"backend": backend, "rank": r}) for r in ranks(self.engine)])

    def start(self) -> JSONResponse:
        gate = self.engine.pause
        if not (gate.paused and gate.barrier_complete):
            raise out_of_order("pause must complete before starting a weight update (POST /pause first)")
        if self.active:
            raise out_of_order("A weight update is already active")
        if self.target is None:
            raise out_of_order("POST /init_weight_transfer_engine first")
        self.active = True
        return acked("Weight update started", [ack({"rank": r}) for r in ranks(self.engine)])

    async def update(self, info: dict) -> JSONResponse:
        if not self.active:
            raise out_of_order("start_weight_update must be called first")
        target = self.target
        if "stage_ids" in info and info["stage_ids"] != target["stage_ids"]:
            raise FieldError("update_info.stage_ids", f"must equal init_weight_transfer_engine's stage_ids "
                                                      f"({target['stage_ids']}), got {info['stage_ids']!r}")
        given = info.get("component")
        if given is not None and target["component"] is not None and given != target["component"]:
            raise FieldError("update_info.component", f"must equal init_weight_transfer_engine's component "
                                                      f"({target['component']!r}), got {given!r}")
        module = component_of(self.engine, "update_info.component", given) if given is not None else target["module"]
        key = "path" if info.get("path") else "weights_path"
        path = info.get(key)
        where = f"update_info.{key if path is not None else 'path'}"
        if not isinstance(path, str) or not path:
            raise FieldError(where, "required: a .safetensors file below --weight-root holding the component's "
                                    "whole state dict (this engine's diffusion stage takes files, no tensors)")
        try:
            done = await self.engine.update_weights_from_disk(module, path, checksum=False)
        except EngineError as e:
            if e.field == "path" or (e.field is None and 400 <= e.status < 500):
                e.field = where  # the file's fault: its path, or what a worker found in it
                e.message = f"{where}: {e.message.removeprefix('path: ')}"
            raise
        return acked("Weights updated", [ack({"rank": w["index"], "component": module,
                                              "weight_version": done["weight_version"], "load_s": w["load_s"]})
                                         for w in done["workers"]])

    def finish(self) -> JSONResponse:
        if not self.active:
            raise out_of_order("No weight update is active")
        self.active = False
        version = self.engine.weights.version
        return acked("Weight update finished", [ack({"rank": r, "weight_version": version})
                                                for r in ranks(self.engine)])


async def weights_checksum(engine: Engine, data: dict) -> JSONResponse:
    """vLLM-Omni's SHA-256 of the component's parameters on every denoise worker."""
    body = WeightsChecksumRequest.model_validate(data)
    check_stages("stage_ids", body.stage_ids)
    module = component_of(engine, "component", body.component)
    out = await engine.weights.checksum(module, "vllm_omni")
    return acked("Weights checksummed", [
        ack({"rank": w["index"], "component": module, "algorithm": "sha256", "checksum": w["sha256"],
             "parameter_count": None, "weight_version": w["weight_version"]}) for w in out["workers"]])


# --- LoRA adapters ------------------------------------------------------------------------------------------
async def load_lora(engine: Engine, ids: dict[str, int], data: dict) -> JSONResponse:
    body = LoadLoRARequest.model_validate(data)
    check_stages("stage_ids", body.stage_ids)
    if body.is_3d_lora_weight:
        raise FieldError("is_3d_lora_weight", "3-D (stacked expert) LoRA weights are not supported here")
    out = await engine.load_lora(LoadLoraBody(lora_name=body.lora_name, lora_path=body.lora_path))
    lora_int_id = ids[body.lora_name] = stable_lora_int_id(body.lora_path)
    return acked(f"LoRA adapter '{body.lora_name}' loaded", [
        ack({"rank": w["index"], "lora_name": body.lora_name, "lora_int_id": lora_int_id,
             "lora_version": out["lora_version"], "sha256": w["sha256"]}) for w in out["workers"]])


async def unload_lora(engine: Engine, ids: dict[str, int], data: dict) -> JSONResponse:
    body = UnloadLoRARequest.model_validate(data)
    check_stages("stage_ids", body.stage_ids)
    known = ids.get(body.lora_name)
    if body.lora_int_id is not None and known is not None and body.lora_int_id != known:
        raise FieldError("lora_int_id", f"adapter {body.lora_name!r} was loaded as lora_int_id {known}")
    await engine.unload_lora(body.lora_name)
    ids.pop(body.lora_name, None)
    lora_int_id = body.lora_int_id or known
    return acked(f"LoRA adapter '{body.lora_name}' unloaded", [
        ack({"rank": r, "lora_name": body.lora_name, "lora_int_id": lora_int_id}) for r in ranks(engine)])


# --- sleep and wake -----------------------------------------------------------------------------------------
def in_flight(engine: Engine) -> int:
    """Generations running (router/link/cancel.py)."""
    return engine.cancels.running()


async def pause(engine: Engine, mode: str) -> None:
    if mode not in MODES:
        raise FieldError("mode", f"must be one of {', '.join(MODES)}, got {mode!r}")
    await engine.pause.pause(mode, engine.abort_all, lambda: in_flight(engine),
                             engine.config.limits.request_timeout_s)


async def sleep(engine: Engine, request: Request) -> Response:
    """``/sleep?level=&mode=&stage_ids=``: pause (``mode``), then every component's weights released."""
    stage_ids(request)
    level = int_param(request, "level", 1)
    if level not in (1, 2):
        raise FieldError("level", f"must be 1 (weights to host memory) or 2 (dropped), got {level}")
    await pause(engine, request.query_params.get("mode", "abort"))
    try:
        await engine.release_memory(None, level, "wait")
    except BaseException:
        engine.pause.resume()
        raise
    return Response(status_code=200, media_type="text/plain")


async def wake_up(engine: Engine, request: Request) -> Response:
    """``/wake_up?stage_ids=&tags=`` (and this engine's ``reload=disk``): the tagged components resumed; once
    none sleeps, generations resume."""
    stage_ids(request)
    tags = request.query_params.getlist("tags")
    ours = [t for t in tags if t != NO_TAG]
    reload = request.query_params.get("reload")
    if reload not in (None, "disk"):
        raise FieldError("reload", f"must be disk, got {reload!r}")
    if ours or not tags:
        await engine.resume_memory(ours or None, reload)
    if not engine.sleep_state()["is_sleeping"]:
        engine.pause.resume()
    return Response(status_code=200, media_type="text/plain")


def sleep_status(engine: Engine) -> dict:
    state = engine.sleep_state()
    asleep = sorted(t for t, c in state["components"].items() if c["sleeping"])
    return {"is_sleeping": state["is_sleeping"], "stages": [{"stage_id": STAGE_ID, "is_sleeping": state["is_sleeping"]}],
            "tags": asleep, "components": state["components"]}


def omni_acks(workers: list[dict], state: str | None = None) -> list[dict]:
    """OmniACKs, one per worker (its role's index as rank)."""
    out = []
    for w in workers:
        freed = int(w.get("released_bytes", 0))
        meta = {"source": "disagg-diffusion", "role": w["role"], "total_freed_gib": f"{freed / 2**30:.4f}"}
        if state is not None:
            meta = {"source": "disagg-diffusion", "role": w["role"], "state": state}
        out.append({"task_id": uuid.uuid4().hex, "status": "SUCCESS", "stage_id": STAGE_ID, "rank": w["index"],
                    "freed_bytes": freed, "metadata": meta, "error_msg": None})
    return out


async def omni_sleep(engine: Engine, data: dict) -> JSONResponse:
    body = OmniSleepRequest.model_validate(data)
    check_stages("stage_ids", body.stage_ids)
    if body.level not in (1, 2):
        raise FieldError("level", f"must be 1 (weights to host memory) or 2 (dropped), got {body.level}")
    out = await engine.release_memory(None, body.level, "wait")
    return JSONResponse({"status": "SUCCESS", "acks": omni_acks(out["workers"])})


async def omni_wakeup(engine: Engine, data: dict) -> JSONResponse:
    body = OmniWakeupRequest.model_validate(data)
    check_stages("stage_ids", body.stage_ids)
    if not engine.sleep_state()["is_sleeping"]:
        return JSONResponse({"status": "SKIPPED", "reason": "Target stages are not sleeping."})
    out = await engine.resume_memory(None)
    return JSONResponse({"status": "SUCCESS", "acks": omni_acks(out["workers"], "WARM")})
