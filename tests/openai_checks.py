"""Checks of a launched engine through the official ``openai`` client, shared by the families' engine tests."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
from PIL import Image

from common.protocol.http_tensors import body_to_tensor
from router.api.media import to_uint8


def assert_images_are_the_pixels_of_generate(eng, request: dict, width: int = 64, height: int = 48) -> None:
    """``/v1/images/generations`` with ``request``'s fields: two PNGs, each ``/generate``'s frames for those seeds
    as round(255 x), byte for byte, and different from each other; the served model lists its family."""
    fields = {k: v for k, v in request.items() if k != "prompt"}
    with openai.OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0) as c:
        assert c.models.list().data[0].model_extra["family"] == eng.http.get("/health").json()["family"]
        out = c.images.generate(prompt=request["prompt"], size=f"{width}x{height}", n=2, response_format="b64_json",
                                extra_body=fields)
    pngs = [np.array(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in out.data]
    r = eng.http.post("/generate", json={**request, "width": width, "height": height, "n": 2})
    assert r.status_code == 200, r.text
    ref = [body_to_tensor(s["output"]) for s in r.json()["samples"]]
    assert [p.shape for p in pngs] == [(height, width, 3)] * 2 and not np.array_equal(pngs[0], pngs[1])
    for png, frames in zip(pngs, ref):
        assert np.array_equal(png, to_uint8(frames)[0])
