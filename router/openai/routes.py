"""OpenAI-style endpoints over the engine: ``/v1/models``, ``/v1/images/generations``, ``/v1/images/edits``
(router/openai/edits.py) and ``/v1/videos`` jobs.

Shapes as OpenAI's API defines them, so that the official ``openai`` package
works unchanged (``base_url=".../v1"``). An image is a one-frame generation
returned as PNG; a video is a job whose content is an MP4. The engine's own fields
(negative prompt, steps, guidance, seed, LoRA) come as extra body fields.
"""

from __future__ import annotations

import asyncio
import base64
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from common.protocol.messages import OUTPUT
from router.api import answers, media
from router.api.bodies import check_declared_length, parse_body, read_form
from router.api.cancel_api import gone_of
from router.api.openapi import BINARY, IMAGE_ID_PATH, LIST_QUERY, VIDEO_ID_PATH, errors, ok, request_body
from router.api.request_ids import REQUEST_ID_PARAMETER, request_id_of
from router.request.schemas import GenerateBody
from router.core.engine import Engine
from router.core.errors import FieldError
from router.core.job_store import JobRow
from router.core.jobs import IMAGE, VIDEO, Runner, Started
from router.openai.edits import edit_images
from router.openai.schemas import EditsBody, EngineFields, ImagesBody, VideoBody, family_fields, frames_for, parse_size, seconds_of

# OpenAI's name for the engine's image field: errors about the image name what the caller sent.
INPUT_REFERENCE = {"image": "input_reference"}
POLL_AFTER_MS = 250  # what a polling client is told to wait between retrieves
# /v1/videos as multipart form fields: input_reference is an image file there; in JSON {"image_url": "data:..."}.
VIDEO_FORM_FILES = {"input_reference": {**BINARY, "description": "image-to-video models: the first frame"}}
# /v1/images/edits as multipart: the image file(s); in JSON, image is base64 or data: URLs.
EDIT_FORM_FILES = {"image": {"anyOf": [BINARY, {"type": "array", "items": BINARY}],
                             "description": "the image to edit (image[] for each of several)"}}


class OpenAIRoutes:
    """The OpenAI endpoints: each parses its request into the engine's terms, calls the engine and answers."""

    def __init__(self, engine: Engine):
        self.engine, self.info, self.config = engine, engine.info, engine.config
        self.model_id, self.jobs = engine.model_id, engine.jobs

    def check_model(self, model: str | None) -> None:
        """A body's ``model``, if given, must be the served one."""
        if model is not None and model != self.model_id:
            raise FieldError("model", f"this engine serves {self.model_id!r} (GET /v1/models), not {model!r}")

    def params_for(self, gen: GenerateBody, from_seconds: bool = False, image_name: str = INPUT_REFERENCE["image"],
                images: dict | None = None):
        """The request's parameters (``images``: its decoded pixels, which an edit's default size follows); a
        bound that ``size`` (or ``seconds``) broke names that OpenAI field, an image error ``image_name`` (the
        endpoint's name for it)."""
        renames = {"width": "size", "height": "size", "image": image_name,
                   **({"num_frames": "seconds"} if from_seconds else {})}
        try:
            return self.engine.params_for(gen, images)
        except FieldError as e:
            if e.field in renames and renames[e.field] != e.field:
                raise FieldError(renames[e.field], f"{e.field} {str(e).removeprefix(e.field + ': ')}") from None
            raise

    def generate_body(self, body, width: int, height: int, frames: int, n: int, output_type: str) -> GenerateBody:
        """An OpenAI body (its engine fields and the served family's own) as the native request."""
        extra = {k: getattr(body, k) for k in EngineFields.model_fields if k != "cache"}
        extra.update(family_fields(body))  # the served family's own, passed through as they came
        if getattr(body, "image", None) is not None:
            extra["image"] = body.image
        if "cache" in body.model_fields_set:  # left out: the engine's --cache; null: off
            extra["cache"] = body.cache
        return GenerateBody(prompt=body.prompt, width=width, height=height, num_frames=frames, n=n,
                            output_type=output_type, **extra)

    # --- GET /v1/models ---------------------------------------------------------------
    async def models(self) -> JSONResponse:
        return JSONResponse(self.engine.models())

    # --- POST /v1/images/generations --------------------------------------------------
    async def images(self, request: Request) -> JSONResponse:
        rid = request_id_of(request)
        body = ImagesBody.model_validate(await parse_body(request, self.config.limits.max_body_bytes))
        self.check_model(body.model)
        width, height = parse_size(body.size, self.info.defaults)
        params = self.params_for(self.generate_body(body, width, height, 1, body.n, "png"))
        outcome = await self.engine.run(params, rid, body.timeout_s, gone=gone_of(request))
        return await self.images_answer(body.prompt, outcome, params.n)

    async def images_answer(self, prompt: str, outcome, n: int) -> JSONResponse:
        """OpenAI's images answer of a generation's ``n`` samples (PNGs, the size made), recorded for
        GET /v1/images too."""
        pngs = await asyncio.to_thread(
            lambda: [media.png_bytes(outcome.sample(i).tensors[OUTPUT.name]) for i in range(n)])
        size = media.frame_size(outcome.sample(0).tensors[OUTPUT.name])
        await self.jobs.record_images(prompt, self.model_id, size, pngs)
        return JSONResponse({"created": int(time.time()), "output_format": "png", "size": size,
                             "data": [{"b64_json": base64.b64encode(p).decode("ascii")} for p in pngs]})

    # --- POST /v1/images/edits -------------------------------------------------------
    async def edit_images(self, request: Request) -> JSONResponse:
        return await edit_images(self, request)

    # --- /v1/videos -----------------------------------------------------------------------
    async def _video_fields(self, request: Request) -> dict:
        """The body as fields: multipart form (the official client) or JSON. ``input_reference`` (image to
        video) becomes the engine's ``image``: a file part's bytes as base64, or JSON's
        ``{"image_url": "data:..."}``."""
        limit = self.engine.sample_body_limit()
        if "multipart/form-data" not in request.headers.get("content-type", ""):
            fields = await parse_body(request, limit)
            ref = fields.pop("input_reference", None) if isinstance(fields, dict) else None
            if ref is not None:
                if not isinstance(ref, dict) or set(ref) != {"image_url"} or not isinstance(ref["image_url"], str):
                    raise FieldError("input_reference", 'must be {"image_url": "data:image/...;base64,..."} (or '
                                     "a multipart file)")
                fields["image"] = ref["image_url"]
            return fields
        check_declared_length(request, limit, required=True)  # the form parser reads the body itself
        form = await read_form(request, limit)  # text fields that are not UTF-8: a 400 naming them
        try:
            fields = {k: v for k, v in form.items() if isinstance(v, str)}
            ref = form.get("input_reference")
            if ref is not None:
                if isinstance(ref, str):
                    raise FieldError("input_reference", "must be an image file (multipart), not a text field")
                raw = await ref.read(self.config.limits.max_image_bytes + 1)
                fields["image"] = base64.b64encode(raw).decode("ascii")  # router/request/images.py checks it whole
        finally:
            await form.close()
        return fields

    async def create_video(self, request: Request) -> JSONResponse:
        body = VideoBody.model_validate(await self._video_fields(request))
        size, seconds, run = await self._video_run(body)
        request_fields = body.model_dump(mode="json", exclude_unset=True)  # what runs it again after a restart
        return self._job(self.jobs.create(body.prompt, self.model_id, size, seconds, request_fields, run))

    async def _video_run(self, body: VideoBody) -> tuple[str, str, Runner]:
        """Every check of a video job (a new one, or one run again after a restart): its size, its seconds,
        and how to run it."""
        self.check_model(body.model)
        if not self.info.family.video:
            raise FieldError("model", f"{self.model_id!r} ({self.info.family.pipeline}) makes images: "
                             "use /v1/images/generations")
        # Left out: the model's size for the request (where a model's size follows its image, as an image-to-video
        # pipeline's aspect bucket, that size: the model refuses one given).
        width, height = (None, None) if body.size is None else parse_size(body.size, self.info.defaults)
        frames = frames_for(body.seconds, body.num_frames, self.info.fps, self.info.defaults["num_frames"],
                            self.info.vae_scale_temporal)
        gen = self.generate_body(body, width, height, frames, 1, "frames")
        images = await self.engine.images_of(gen, names=INPUT_REFERENCE)  # first: the size may follow the image
        params = self.params_for(gen, from_seconds=body.num_frames is None and body.seconds is not None, images=images)
        timeout_s = body.timeout_s or self.config.limits.request_timeout_s

        async def run(started: Started) -> bytes:
            outcome = await self.engine.run_job(params, timeout_s, images, started)
            sample = outcome.sample(0)  # the MP4 carries its sound where the model makes sound
            return await asyncio.to_thread(media.mp4_bytes, sample.tensors[OUTPUT.name],
                                           media.video_fps(params, self.info), media.sound_of(sample))

        return f"{params.width}x{params.height}", seconds_of(frames, self.info.fps), run

    async def rerun(self, row: JobRow, request: dict) -> Runner:
        """A job stored by an earlier start, checked again as a new one (router/core/jobs.py fails it if it raises)."""
        if row.model != self.model_id:
            raise FieldError("model", f"this engine now serves {self.model_id!r}, not {row.model!r}")
        try:
            body = VideoBody.model_validate(request)
        except ValidationError as e:
            first = e.errors()[0]
            raise FieldError(".".join(map(str, first["loc"])) or "body", first["msg"]) from None
        return (await self._video_run(body))[2]

    def _job(self, described: dict) -> JSONResponse:
        return JSONResponse(described, headers={"openai-poll-after-ms": str(POLL_AFTER_MS)})

    # Path parameters are read by hand, like the bodies: a bad one is the router's 400, never FastAPI's 422.
    async def retrieve_video(self, request: Request) -> JSONResponse:
        return self._job(self.jobs.describe(request.path_params["video_id"], VIDEO))

    async def list_videos(self, request: Request) -> JSONResponse:
        return self._listed(request, VIDEO)

    async def list_images(self, request: Request) -> JSONResponse:
        return self._listed(request, IMAGE)

    def _listed(self, request: Request, kind: str) -> JSONResponse:
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise FieldError("order", f"must be asc or desc, got {order!r}")
        limit = q.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise FieldError("limit", f"must be an integer within 1..100, got {limit!r}")
        data, more = self.jobs.listed(kind, q.get("after"), int(limit), order)
        return JSONResponse({"object": "list", "data": data, "has_more": more,
                             "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None})

    async def delete_video(self, request: Request) -> JSONResponse:
        video_id = request.path_params["video_id"]
        await self.engine.delete_job(video_id)
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    async def video_content(self, request: Request) -> Response:
        video_id = request.path_params["video_id"]
        variant = request.query_params.get("variant", "video")
        if variant != "video":
            raise FieldError("variant", f"only video (the MP4) is kept, not {variant!r}")
        return Response(await self.jobs.content(video_id, VIDEO), media_type=media.MP4,
                        headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})

    async def image_content(self, request: Request) -> Response:
        image_id = request.path_params["image_id"]
        return Response(await self.jobs.content(image_id, IMAGE), media_type=media.PNG,
                        headers={"Content-Disposition": f'attachment; filename="{image_id}.png"'})


def add_openai_routes(app: FastAPI, api: OpenAIRoutes) -> None:
    app.add_api_route("/v1/models", api.models, methods=["GET"], summary="The served model (OpenAI-style)",
                      responses={**ok(answers.Models), **errors(401)})
    app.add_api_route("/v1/images/generations", api.images, methods=["POST"],
                      summary="Images (one-frame generations) as base64 PNGs (OpenAI-style)",
                      openapi_extra={**request_body(ImagesBody), "parameters": [REQUEST_ID_PARAMETER]},
                      responses={**ok(answers.Images), **errors(400, 401, 409, 413, 429, 499, 500, 503, 504)})
    app.add_api_route("/v1/images/edits", api.edit_images, methods=["POST"],
                      summary="Edited images as base64 PNGs (OpenAI-style; multipart form or JSON)",
                      openapi_extra={**request_body(EditsBody, form=EDIT_FORM_FILES),
                                     "parameters": [REQUEST_ID_PARAMETER]},
                      responses={**ok(answers.Images), **errors(400, 401, 409, 413, 429, 499, 500, 503, 504)})
    app.add_api_route("/v1/videos", api.create_video, methods=["POST"],
                      summary="Create a video job (OpenAI-style; multipart form or JSON)",
                      openapi_extra=request_body(VideoBody, form=VIDEO_FORM_FILES),
                      responses={**ok(answers.Job, "the job, queued"), **errors(400, 401, 413, 429)})
    app.add_api_route("/v1/videos", api.list_videos, methods=["GET"], summary="The video jobs held",
                      openapi_extra=LIST_QUERY, responses={**ok(answers.Jobs), **errors(400, 401)})
    app.add_api_route("/v1/videos/{video_id}", api.retrieve_video, methods=["GET"], openapi_extra=VIDEO_ID_PATH,
                      summary="A video job: status and progress", responses={**ok(answers.Job), **errors(401, 404)})
    app.add_api_route("/v1/videos/{video_id}", api.delete_video, methods=["DELETE"], openapi_extra=VIDEO_ID_PATH,
                      summary="Delete a video job (one not yet ended is cancelled first)",
                      responses={**ok(answers.JobDeleted), **errors(401, 404)})
    app.add_api_route("/v1/videos/{video_id}/content", api.video_content, methods=["GET"],
                      openapi_extra={"parameters": [*VIDEO_ID_PATH["parameters"], {
                          "name": "variant", "in": "query", "required": False,
                          "schema": {"type": "string", "enum": ["video"]}}]},
                      summary="A completed job's MP4", response_class=Response,
                      responses={**ok(None, "the MP4", media=[media.MP4]), **errors(400, 401, 404, 409, 500)})
    # The engine's own (not OpenAI's): the images /v1/images/generations made, kept as --job-ttl says.
    app.add_api_route("/v1/images", api.list_images, methods=["GET"], openapi_extra=LIST_QUERY,
                      summary="The images generated recently (engine extension)",
                      responses={**ok(answers.Jobs), **errors(400, 401)})
    app.add_api_route("/v1/images/{image_id}/content", api.image_content, methods=["GET"],
                      openapi_extra=IMAGE_ID_PATH, summary="A generated image's PNG (engine extension)",
                      response_class=Response, responses={**ok(None, "the PNG", media=[media.PNG]),
                                                          **errors(401, 404, 500)})
