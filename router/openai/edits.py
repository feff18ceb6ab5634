"""``POST /v1/images/edits`` as OpenAI defines it: the image(s) to edit and a prompt in, PNGs out.

The official client sends a multipart form: the file ``image`` (one) or ``image[]`` (several), OpenAI's fields,
and ``extra_body`` as more form fields (text: ``"4"``; a dict ``cache`` as ``cache[method]``). A JSON body with
``image`` as base64 or data: URLs (one, or a list) is taken too. The files go through the same decoding and
refusals as ``/generate``'s ``image`` (router/request/images.py); the request runs as a one-frame ``/generate``
with those images, so its PNGs are ``/generate``'s pixels for the same fields and seed.
"""

from __future__ import annotations

import base64
import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse

from router.api.bodies import check_declared_length, parse_body, read_form
from router.api.cancel_api import gone_of
from router.api.request_ids import request_id_of
from router.request.schemas import MAX_IMAGES
from router.core.errors import FieldError
from router.openai.schemas import EditsBody, parse_size

IMAGE_KEYS = ("image", "image[]")  # the client's names: one file, or each of a list
# The form's files: the images, and room for one more part a caller may send (mask) to be refused by name.
MAX_FILES = MAX_IMAGES + 1
_NESTED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\[([A-Za-z_][A-Za-z0-9_]*)\]$")  # the client's cache[method]


def _nested_value(text: str):
    """A nested form value as the JSON number or boolean it spells, else the text (CacheBody is strict)."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if isinstance(parsed, (bool, int, float)) else text


async def edit_fields(request: Request, limit: int, max_image_bytes: int) -> dict:
    """The body as fields, ``image`` a base64 string (one image) or a list of them (several)."""
    if "multipart/form-data" not in request.headers.get("content-type", ""):
        return await parse_body(request, limit)
    check_declared_length(request, limit, required=True)  # the form parser reads the body itself
    form = await read_form(request, limit, max_files=MAX_FILES)  # text that is not UTF-8: a 400 naming it
    fields: dict = {}
    images: list[str] = []
    try:
        for key, value in form.multi_items():
            if key in IMAGE_KEYS:
                if not isinstance(value, str):  # a file: its bytes, checked whole by router/request/images.py
                    value = base64.b64encode(await value.read(max_image_bytes + 1)).decode("ascii")
                images.append(value)
            elif not isinstance(value, str):
                raise FieldError(key, "is a file: this endpoint takes files as image (or image[]) only; the "
                                      "engine edits the whole image (no mask)")
            elif (nested := _NESTED.match(key)) is not None:
                fields.setdefault(nested.group(1), {})[nested.group(2)] = _nested_value(value)
            else:
                fields[key] = value
    finally:
        await form.close()
    if images:
        # One file is the one image, whichever name it came under (the client sends a list of one as image[]).
        fields["image"] = images[0] if len(images) == 1 else images
    return fields


async def edit_images(api, request: Request) -> JSONResponse:
    """``/v1/images/edits`` on the engine behind ``api`` (router/openai/routes.py's :class:`OpenAIRoutes`)."""
    rid = request_id_of(request)
    engine = api.engine
    body = EditsBody.model_validate(await edit_fields(request, engine.sample_body_limit(),
                                                      api.config.limits.max_image_bytes))
    api.check_model(body.model)
    # auto (or left out): the model's size for these images (an edit model's from the image, else its default).
    width, height = (None, None) if body.size in (None, "auto") else parse_size(body.size, api.info.defaults)
    gen = api.generate_body(body, width, height, 1, body.n, "png")
    images = await engine.images_of(gen)  # first: an edit model's default size follows the images
    params = api.params_for(gen, image_name="image", images=images)
    outcome = await engine.run(params, rid, body.timeout_s, images, gone=gone_of(request))
    return await api.images_answer(body.prompt, outcome, params.n)
