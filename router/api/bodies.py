"""Request bodies in (size-limited JSON or msgpack) and response bodies out.

Bodies are read by hand rather than by FastAPI's parameter binding so that a
too large body is refused before it is parsed (413) and every bad field
becomes the router's own 400 (see :mod:`router.api.http_errors`).
"""

from __future__ import annotations

import base64
import json

import msgpack
import msgspec
import torch
from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser

from common.diffusion.conditioning import grouped
from common.protocol.http_tensors import tensor_to_body
from common.protocol.messages import (
    AUDIO, CONDITIONING, KL, LOG_PROB_STEPS, LOG_PROBS, OUTPUT, REF_LOG_PROBS, ROLES, STREAM_LOG_PROBS, TRAJECTORY_LATENTS,
    TRAJECTORY_SIGMAS, TRAJECTORY_STEPS, TRAJECTORY_TIMESTEPS,
)
from router.api import media
from router.link.join import PER_SAMPLE_INFO, Outcome
from router.core.errors import FieldError
from router.api.values import check_values

MSGPACK = "application/msgpack"


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"request body exceeds {limit} bytes")
        self.limit = limit


def check_declared_length(request: Request, limit: int, required: bool = False) -> None:
    """Refuse a body whose Content-Length exceeds ``limit`` (or is malformed, or missing when ``required``)."""
    declared = request.headers.get("content-length")
    if declared is None:
        if required:
            raise BodyTooLarge(limit)
    elif not declared.isdigit() or int(declared) > limit:
        raise BodyTooLarge(limit)


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, refused before parsing once it is known (or seen) to exceed ``limit`` bytes."""
    check_declared_length(request, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, limit: int) -> dict:
    """The body as a dict: msgpack if its content-type says so, else JSON."""
    return decode_body(await read_limited(request, limit), request)


def decode_body(raw: bytes, request: Request) -> dict:
    """Raw body bytes as a dict, by the request's content-type."""
    is_msgpack = MSGPACK in request.headers.get("content-type", "")
    try:
        # Strings that are not UTF-8 come through as lone surrogates, so that check_values names their field.
        data = (msgpack.unpackb(raw, raw=False, unicode_errors="surrogateescape") if is_msgpack
                else json.loads(raw or b"null"))
    except Exception as e:
        raise FieldError("body", f"not valid {'msgpack' if is_msgpack else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise FieldError("body", "must be a JSON object")
    check_values(data)
    return data


class _StrictForm(MultiPartParser):
    """Starlette's multipart parser, except that a text field whose bytes are not in the form's charset
    (UTF-8 unless it says otherwise) is a 400 naming the field; Starlette would read it as Latin-1."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset or "utf-8")
            except (UnicodeDecodeError, LookupError):
                raise FieldError(part.field_name or "body", "form fields must be UTF-8 text") from None
        super().on_part_end()


async def read_form(request: Request, max_part_size: int, max_fields: int = 64, max_files: int = 1) -> FormData:
    """A multipart body's fields and files (close it once read); malformed: a 400 naming the body."""
    parser = _StrictForm(request.headers, request.stream(), max_files=max_files, max_fields=max_fields,
                         max_part_size=max_part_size)
    try:
        return await parser.parse()
    except MultiPartException as e:
        raise FieldError("body", e.message) from None


def wants_msgpack(request: Request) -> bool:
    return MSGPACK in request.headers.get("accept", "")


def encode_response(payload: dict, request: Request) -> Response:
    """JSON, or msgpack (tensors as raw bytes) when the client accepts it."""
    if wants_msgpack(request):
        return Response(msgpack.packb(payload, use_bin_type=True), media_type=MSGPACK)
    return Response(json.dumps(payload), media_type="application/json")


# The response's ``trajectory`` object: its keys and the wire tensors they come from.
STEP_VERSIONS = ("step_weight_versions", "step_lora_versions")  # a rollout's per-step tags (one list per request)
TRAJECTORY_BODY = {"latents": TRAJECTORY_LATENTS, "timesteps": TRAJECTORY_TIMESTEPS, "sigmas": TRAJECTORY_SIGMAS}


def as_uint8(frames: torch.Tensor) -> torch.Tensor:
    """Frames in [0, 1] as bytes, as diffusers makes PIL images of them: round(x * 255)."""
    return (frames.float() * 255).round().clamp(0, 255).to(torch.uint8)


def sample_body(seed: int, o: Outcome, binary: bool, output: dict | None = None, uint8: bool = False) -> dict:
    """One sample of a ``/generate`` or ``/rollout/generate`` answer (``output``: its file instead of its tensor;
    ``uint8``: frames as bytes)."""
    t = o.tensors
    frames = t[OUTPUT.name]
    body = {
        "seed": seed,
        "output": output if output is not None else tensor_to_body(as_uint8(frames) if uint8 else frames, binary),
        "route": msgspec.structs.asdict(o.route),
        "weight_version": o.info.get("weight_version"),
    }
    if AUDIO.name in t and output is None:  # a model with sound: its waveform beside the frames (a file has it)
        body["audio"], body["sample_rate"] = tensor_to_body(t[AUDIO.name], binary), o.info["audio_sample_rate"]
    if "scheduler" in o.info:
        body["scheduler"] = o.info["scheduler"]
    if "schedule" in o.info:
        body["schedule"] = o.info["schedule"]  # "rollout" or "serving": whose sigmas and timesteps ran
    if "batch" in o.info:
        body["batch"] = o.info["batch"]  # the most requests this sample shared a denoise forward with
    if "sde_window" in o.info:
        body["sde_window"] = o.info["sde_window"]  # the SDE steps [start, stop) its request's seed picked
    for key in PER_SAMPLE_INFO:  # its full transformer forwards (per CFG branch) and its reused row-steps
        if key in o.info:
            body[key] = o.info[key]
    if "prefix_transformer_passes" in o.info:  # share_prefix: the group's shared forwards, counted once
        body["prefix_transformer_passes"] = o.info["prefix_transformer_passes"]
    body["lora_name"], body["lora_version"] = o.info.get("lora_name"), o.info.get("lora_version")
    if LOG_PROBS.name in t:
        body["log_probs"] = tensor_to_body(t[LOG_PROBS.name], binary)
        body["log_prob_steps"] = tensor_to_body(t[LOG_PROB_STEPS.name], binary)
    for f in STREAM_LOG_PROBS.values():  # several latent streams: each SDE stream's own, beside the joint
        if f.name in t:
            body[f.name] = tensor_to_body(t[f.name], binary)
    for key in STEP_VERSIONS:  # a rollout's steps, each tagged with the versions it ran on
        if key in o.info:
            body[key] = o.info[key]
    if KL.name in t:  # return_kl: beside log_probs, the same steps
        body["kl"], body["ref_log_probs"] = (tensor_to_body(t[f.name], binary) for f in (KL, REF_LOG_PROBS))
        body["log_prob_steps"] = tensor_to_body(t[LOG_PROB_STEPS.name], binary)
    if TRAJECTORY_LATENTS.name in t:
        body["trajectory"] = {key: tensor_to_body(t[f.name], binary) for key, f in TRAJECTORY_BODY.items()}
        if TRAJECTORY_STEPS.name in t:  # trajectory_steps: the entries its latents hold
            body["trajectory"]["steps"] = tensor_to_body(t[TRAJECTORY_STEPS.name], binary)
    return body


def samples_payload(request_id: str, seeds: list[int], outcome: Outcome, n: int, total_s: float, binary: bool,
                    files: list[dict] | None = None, uint8: bool = False) -> dict:
    """The whole answer: every sample (``seeds``: each one's), the request's stage timings, its weight version.

    The n samples went through the stages as one unit, so they share their timings, route and weights.
    ``files``: each sample's output as a file (``{"media_type", "data"}``) instead of its tensor.
    """
    # Every stage's timings as the workers reported them (the encoder's image_encode_s on image-to-video
    # requests too), the three stages always, 0.0 for one the request skipped.
    timings = {"encode_s": 0.0, "denoise_s": 0.0, "decode_s": 0.0, **outcome.timings, "total_s": total_s}
    payload = {
        "request_id": request_id,
        "samples": [sample_body(seeds[i], outcome.sample(i), binary, files[i] if files else None, uint8)
                    for i in range(n)],
        "timings": timings,
        # Each stage's peak memory while it held the request, bytes; null for a stage it skipped (decode for
        # latents).
        "peak_memory": {role: outcome.peak_memory.get(role) for role in ROLES},
        "weight_version": outcome.info.get("weight_version"),
        "attempts": outcome.info.get("attempts", 1),  # runs it took: more than 1 when a worker died holding it
    }
    env = {k.removeprefix(CONDITIONING.name): t for k, t in outcome.tensors.items() if CONDITIONING.names(k)}
    if env:  # return_conditioning: the request's, shared by its samples
        payload["conditioning"] = {k: ({n: tensor_to_body(x, binary) for n, x in v.items()} if isinstance(v, dict)
                                       else tensor_to_body(v, binary)) for k, v in grouped(env).items()}
    return payload


def media_response(request_id: str, seeds: list[int], outcome: Outcome, n: int, kind: str, fps: float,
                   total_s: float, request: Request, bare: bool) -> Response:
    """Frames as files (``kind``: png, mp4, or wav: the sound alone), an MP4 with the sound of a model that
    makes sound. ``bare`` (one sample, no rollout tensors): the file itself, its facts in headers; else the
    usual answer with each sample's ``output`` a ``{"media_type", "data"}`` (base64 in JSON). CPU-bound (video
    encoding): call it off the event loop."""
    samples = [outcome.sample(i) for i in range(n)]
    files = [media.encode(s.tensors[OUTPUT.name], kind, fps, media.sound_of(s)) for s in samples]
    if bare:
        return Response(files[0], media_type=media.MEDIA_TYPES[kind], headers={
            "X-Request-Id": request_id, "X-Seed": str(seeds[0]),
            "X-Weight-Version": str(outcome.info.get("weight_version")), "X-Total-Seconds": f"{total_s:.3f}",
            "X-Attempts": str(outcome.info.get("attempts", 1))})
    binary = wants_msgpack(request)
    data = [{"media_type": media.MEDIA_TYPES[kind], "data": f if binary else base64.b64encode(f).decode("ascii")}
            for f in files]
    return encode_response(samples_payload(request_id, seeds, outcome, n, total_s, binary, data), request)
