"""The request surface of models that take images (edits, image-to-video): ``image`` as one image or a list on
``/generate``, OpenAI's ``/v1/images/edits`` through the official ``openai`` client, ``max_images`` in
``/v1/models`` and the Python client, and the refusals (400 naming the field, a list's item by its index).

In process: the body schema's one-or-a-list rule, each item of a list decoded to its wire tensor under its
own name, the body limit growing with the images a model takes. Launched (one shared engine per model; each
model in ``MODELS`` is a parameter): the edit's PNG equals ``/generate``'s for the same fields and seed, the
same refusals as ``/generate``'s ``image`` for uploaded files, a text-to-video model refusing an edit, and
``disagg generate --image`` writing ``/generate``'s pixels.
"""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import numpy as np
import openai
import pytest
from pydantic import ValidationError
from PIL import Image

from common.config.engine import Limits
from common.protocol.http_tensors import body_to_tensor
from common.protocol.messages import IMAGE, IMAGE_2, IMAGE_3, LAST_IMAGE
from router.api.media import to_uint8
from router.request.schemas import MAX_IMAGES, GenerateBody
from router.client import EngineClient, image_field
from router.core.engine import Engine as RouterEngine
from router.core.errors import FieldError
from test_cli import disagg, failed_with
from test_images import REFUSED
from test_wan_i2v import picture

# The models whose edits are checked against /generate: name -> (the images it takes, fields every request
# gives). tiny-wan-i2v makes one frame with num_frames=1, so its edit is an image.
MODELS = {"tiny-qwen-image-edit-plus": (3, {"num_inference_steps": 2, "negative_prompt": "blurry", "true_cfg_scale": 4.0}),
          "tiny-flux-kontext": (1, {"num_inference_steps": 2, "guidance_scale": 2.5})}
TEXT_ONLY = "tiny"  # a text-to-video model: no image anywhere
PICTURES = [picture(40, 24, 1), picture(24, 40, 2), picture(36, 36, 3)]
PROMPT = "the same scene at night"


def _png(im: Image.Image) -> bytes:
    out = io.BytesIO()
    im.save(out, format="PNG")
    return out.getvalue()


def _pixels(png: bytes) -> np.ndarray:
    return np.array(Image.open(io.BytesIO(png)))


# --- in process ------------------------------------------------------------------------------------------
def test_the_body_takes_one_image_or_a_list_of_up_to_three():
    one, some = GenerateBody(prompt="p", image="abc"), GenerateBody(prompt="p", image=["a", "b", "c"])
    assert (one.image, some.image) == ("abc", ["a", "b", "c"])
    for bad in ([], ["a"] * (MAX_IMAGES + 1), ["a", 1], {"a": 1}, 3):
        with pytest.raises(ValidationError) as e:
            GenerateBody.model_validate({"prompt": "p", "image": bad})
        assert e.value.errors()[0]["loc"] == ("image",)
    schema = GenerateBody.model_json_schema()["properties"]["image"]
    assert {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_IMAGES} in schema["anyOf"]


def _images_of(body: GenerateBody, names=None) -> dict:
    """The router engine's decoding of a body's images, without an engine (it reads only the limits and the
    model, here one that takes images)."""
    from common.builtin import ensure_builtin
    from common.families import read_model

    fake = SimpleNamespace(config=SimpleNamespace(limits=Limits()),
                           info=read_model(ensure_builtin("tiny-qwen-image-edit-plus")))
    return asyncio.run(RouterEngine.images_of(fake, body, names))


def test_each_image_of_a_list_goes_to_its_wire_tensor_and_a_bad_one_is_named_by_its_index():
    b64 = [image_field(p) for p in PICTURES]
    out = _images_of(GenerateBody(prompt="p", image=b64))
    assert list(out) == [IMAGE.name, IMAGE_2.name, IMAGE_3.name]
    for wire, im in zip(out.values(), PICTURES):  # each decoded independently, in order
        assert np.array_equal(wire.numpy(), np.asarray(im))
    one = _images_of(GenerateBody(prompt="p", image=b64[1], last_image=b64[2]))
    assert list(one) == [IMAGE.name, LAST_IMAGE.name] and np.array_equal(one[IMAGE.name].numpy(), np.asarray(PICTURES[1]))
    for index in (0, 2):
        bad = list(b64)
        bad[index] = REFUSED["half_png"][0]
        with pytest.raises(FieldError) as e:
            _images_of(GenerateBody(prompt="p", image=bad))
        assert e.value.field == f"image[{index}]" and "truncated PNG" in e.value.message
    with pytest.raises(FieldError) as e:  # what an endpoint calls the field names the item too
        _images_of(GenerateBody(prompt="p", image=[b64[0], "https://example.com/a.png"]), {"image": "input"})
    assert e.value.field == "input[1]"


def test_the_body_limit_grows_with_the_images_a_model_takes():
    limits = Limits()
    one_image = 4 * -(-limits.max_image_bytes // 3)

    def limit(takes: int, last: bool) -> int:
        condition = SimpleNamespace(image_input=lambda info: "required" if takes else None,
                                    last_image_input=lambda info: "optional" if last else None,
                                    images_allowed=lambda info: takes)
        fake = SimpleNamespace(config=SimpleNamespace(limits=limits),
                               info=SimpleNamespace(family=SimpleNamespace(condition=condition)))
        return RouterEngine.sample_body_limit(fake)

    assert limit(0, False) == limits.max_body_bytes
    assert limit(1, True) == limit(1, False) == limits.max_body_bytes + 2 * one_image  # as before: first and last
    assert limit(3, False) == limits.max_body_bytes + 3 * one_image


# --- launched engines -------------------------------------------------------------------------------------
# One model's engine by default (Edit-Plus: lists of up to three images); Kontext's with the heavy tests.
@pytest.fixture(scope="module", params=[pytest.param(m, marks=pytest.mark.heavy) if m == "tiny-flux-kontext" else m
                                        for m in MODELS])
def served(request, shared_engine):
    return request.param, shared_engine(request.param)


@pytest.fixture(scope="module")
def text_only(shared_engine):
    return shared_engine(TEXT_ONLY)


def _openai(engine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def _generate_png(engine, **fields) -> list[np.ndarray]:
    """``/generate``'s samples for the same request, as the 8-bit pixels a PNG holds."""
    r = engine.http.post("/generate", json={"prompt": PROMPT, "num_frames": 1, **fields})
    assert r.status_code == 200, r.text
    return [to_uint8(body_to_tensor(s["output"]))[0] for s in r.json()["samples"]]


def test_models_say_how_many_images_a_model_takes(served, text_only):
    name, engine = served
    with EngineClient(engine.url) as c:
        assert c.model()["max_images"] == c.max_images() == MODELS[name][0]
    with EngineClient(text_only.url) as c:
        assert c.max_images() == 0


def test_openai_edit_is_generates_png(served):
    """The official client's images.edit (one file, a list of one, size given or auto, n=2) answers the PNGs
    /generate gives for the same image, fields and seeds."""
    name, engine = served
    fields = MODELS[name][1]
    image = PICTURES[0]
    with _openai(engine) as client:
        r = client.images.edit(image=("in.png", _png(image), "image/png"), prompt=PROMPT, n=2, size="48x32",
                               response_format="b64_json", extra_body={**fields, "seed": 5})
        listed = client.images.edit(image=[("in.png", _png(image), "image/png")], prompt=PROMPT, size="auto",
                                    extra_body={**fields, "seed": 6})
    edits = [_pixels(base64.b64decode(d.b64_json)) for d in r.data]
    # The size made (Kontext: its max_area at the asked aspect), which the answer reports.
    assert len(r.data) == 2 and r.size == f"{edits[0].shape[1]}x{edits[0].shape[0]}"
    # n=2 is one request (seeds 5, 6), batched as /generate's n=2 is.
    same = _generate_png(engine, image=image_field(image), width=48, height=32, seed=5, n=2, **fields)
    assert all(np.array_equal(edit, ref) for edit, ref in zip(edits, same, strict=True))
    assert not np.array_equal(edits[0], edits[1])
    [auto] = _generate_png(engine, image=image_field(image), seed=6, **fields)
    assert np.array_equal(_pixels(base64.b64decode(listed.data[0].b64_json)), auto)
    assert listed.size == f"{auto.shape[1]}x{auto.shape[0]}"
    # Another image gives another edit: the upload is what ran.
    assert not np.array_equal(auto, _generate_png(engine, image=image_field(PICTURES[1]), seed=6, **fields)[0])


def _edit_error(engine, files, **data) -> dict:
    r = engine.http.post("/v1/images/edits", files=files, data={"prompt": PROMPT, **data})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize("case", ["half_png", "gif", "animated_gif", "not_an_image", "bmp"])
def test_a_bad_upload_is_refused_naming_image(served, case):
    _, engine = served
    raw = base64.b64decode(REFUSED[case][0])
    err = _edit_error(engine, [("image", ("in.png", raw, "image/png"))])
    assert err["field"] == "image" and REFUSED[case][1] in err["message"]


def test_edit_refusals_name_their_field(served):
    name, engine = served
    good = ("in.png", _png(PICTURES[0]), "image/png")
    takes = MODELS[name][0]
    too_many = [("image[]", good)] * (takes + 1)
    assert _edit_error(engine, too_many)["field"] == "image"
    assert _edit_error(engine, [("image", good), ("mask", good)])["field"] == "mask"
    assert _edit_error(engine, [("image", good)], response_format="url")["field"] == "response_format"
    assert _edit_error(engine, [("image", good)], size="12x")["field"] == "size"
    assert _edit_error(engine, [("image", good)], seed="one")["field"] == "seed"
    assert _edit_error(engine, [("image", good)], model="another")["field"] == "model"
    r = engine.http.post("/v1/images/edits", json={"prompt": PROMPT})  # no image at all
    assert r.status_code == 400 and r.json()["error"]["field"] == "image", r.text
    r = engine.http.post("/v1/images/edits", json={"prompt": PROMPT, "image": "https://example.com/a.png"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "image", r.text
    # A list on /generate: too many for the model, a remote URL as an item, last_image beside a list.
    b64 = image_field(PICTURES[0])
    r = engine.http.post("/generate", json={"prompt": PROMPT, "image": [b64] * (takes + 1)})
    assert r.status_code == 400 and r.json()["error"]["field"] == "image", r.text
    r = engine.http.post("/generate", json={"prompt": PROMPT, "image": [b64], "last_image": b64})
    assert r.status_code == 400 and r.json()["error"]["field"] == "last_image", r.text
    if takes >= 2:
        r = engine.http.post("/generate", json={"prompt": PROMPT, "image": [b64, "https://example.com/a.png"]})
        assert r.status_code == 400 and r.json()["error"]["field"] == "image[1]", r.text


def test_a_model_without_image_input_refuses_an_edit(text_only):
    with _openai(text_only) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.images.edit(image=("in.png", _png(PICTURES[0]), "image/png"), prompt=PROMPT)
    assert e.value.body["field"] == "image" and "takes no image" in e.value.body["message"]


def test_the_cli_sends_its_images(served, tmp_path):
    """``disagg generate --image in.png -o out.png``: /generate's pixels for that image; --image again makes a
    list (refused by a model that takes one, with the engine's message); a missing file is a usage error."""
    name, engine = served
    fields = MODELS[name][1]
    src = tmp_path / "in.png"
    src.write_bytes(_png(PICTURES[1]))
    out = tmp_path / "out.png"
    flags = ["--url", engine.url, "--seed", "4", "--steps", str(fields["num_inference_steps"])]
    flags += ["--negative-prompt", fields["negative_prompt"]] if "negative_prompt" in fields else []
    flags += ["--guidance", str(fields["guidance_scale"])] if "guidance_scale" in fields else []
    fields = {k: v for k, v in fields.items() if k != "true_cfg_scale"}  # (the CLI has no flag: the model's default)
    run = disagg("generate", PROMPT, "--image", str(src), "-o", str(out), *flags, key=None)
    assert run.returncode == 0, run.stderr
    [ref] = _generate_png(engine, image=image_field(PICTURES[1]), seed=4, **fields)
    assert np.array_equal(_pixels(out.read_bytes()), ref)
    extra = ["--image", str(src)] * MODELS[name][0]
    run = disagg("generate", PROMPT, "--image", str(src), *extra, "-o", str(out), *flags, key=None)
    failed_with(run, "image")
    run = disagg("generate", PROMPT, "--image", str(tmp_path / "missing.png"), "-o", str(out), *flags, key=None)
    failed_with(run, "--image")


@pytest.mark.heavy
def test_weights_pushed_from_memory_change_an_edit_and_restore_it(engine_factory):
    """Weight sync on an edit model (tiny-flux-kontext, whose transformer takes the reference tokens): the
    trainer's perturbed weights change the edit, its original weights give it back bit for bit."""
    import torch

    from common.builtin import ensure_builtin
    from common.diffusion.weights import state_dict_checksum
    from rl import TrainerPolicy

    engine = engine_factory("tiny-flux-kontext", extra=["--weight-sync-from-memory"])
    body = dict(prompt=PROMPT, image=image_field(PICTURES[0]), seed=3, output_type="latent",
                **MODELS["tiny-flux-kontext"][1])
    trainer = TrainerPolicy(ensure_builtin("tiny-flux-kontext"))
    original = {k: v.detach().clone() for k, v in trainer.transformer.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    with EngineClient(engine.url) as c:
        base = c.generate(**body)["samples"][0]["output"]
        assert c.update_weights_from_tensors(new)["sha256"] == state_dict_checksum(new)
        changed = c.generate(**body)["samples"][0]["output"]
        assert (changed - base).abs().max() > 1e-3
        c.update_weights_from_tensors(original)
        assert torch.equal(c.generate(**body)["samples"][0]["output"], base)
