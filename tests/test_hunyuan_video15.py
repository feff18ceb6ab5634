"""HunyuanVideo 1.5 served equal to diffusers' ``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline``
(latents and frames, same directory and seed) on the built-ins and on another configuration: guidance on and off
(through the directory's guider, its scale the request's), a non-square size, a prompt with quoted text (the ByT5
glyph path), image-to-video with an image resized to the bucket nearest its aspect; and the refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.hunyuan_video15 import SPECS
from common.config.engine import Limits
from common.diffusion.params import FieldError, check_images, to_params
from common.families.hunyuan_video15.text import GLYPH_MASK
from family_harness import ModuleModels, max_diff
from family_harness import gradient_picture as picture

TOL = 1e-4
# Other widths, depth, text encoders, latent channels, bucket size and seed than the built-in's.
X = dataclasses.replace(SPECS["tiny-hunyuan-video15"], name="hv15-test-x", num_layers=2, num_attention_heads=3,
                        attention_head_dim=8, rope_axes_dim=(2, 2, 4), text_hidden_size=64, text_num_heads=4, text_num_kv_heads=2, text_num_layers=4,
                        byt5_d_model=24, latent_channels=4, vae_block_out_channels=(8, 8, 8, 16, 16),
                        image_embed_dim=24, target_size=96, guider_scale=3.5, seed=7)
X_I2V = dataclasses.replace(X, name="hv15-test-x-i2v", image_to_video=True)
OTHER = {X.name: X, X_I2V.name: X_I2V}
QUOTED = 'a shop sign reading "OPEN 24H" and a neon “café” in the rain'

CASES = {
    "cfg-quoted": dict(model="tiny-hunyuan-video15", guidance_scale=6.0, prompt=QUOTED),
    "no-guidance": dict(model="tiny-hunyuan-video15", guidance_scale=1.0),
    # below 1 the guider still runs its second pass
    "cfg-below-one": dict(model="tiny-hunyuan-video15", guidance_scale=0.5),
    "x-tall-quoted": dict(model="hv15-test-x", guidance_scale=4.0, height=96, width=48, num_frames=9, prompt=QUOTED),
    "x-no-guidance": dict(model="hv15-test-x", guidance_scale=1.0, height=32, width=64),
    "i2v": dict(model="tiny-hunyuan-video15-i2v", guidance_scale=5.0, image=(50, 70)),
    "x-i2v-tall-no-guidance": dict(model="hv15-test-x-i2v", guidance_scale=1.0, image=(130, 60), prompt=QUOTED),
}

_MODELS = ModuleModels()
_DIRS: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope(_DIRS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    def get(which: str):
        if which not in _DIRS:
            _DIRS[which] = (ensure_builtin(which) if which in BUILTINS
                            else build_builtin(OTHER[which], tmp_path_factory.mktemp(which)))
        return _DIRS[which]
    return get


def request(eng, case: dict, image):
    """The case as the engine's params (through the router's conversion) and as the pipeline's call."""
    body = {k: v for k, v in case.items() if k not in ("model", "image")}
    body = {"prompt": "a red fox in the snow", "negative_prompt": "blurry", "num_inference_steps": 3, "seed": 5,
            **body}
    sizes = [] if image is None else [image.size]
    p = to_params(body, eng.info, Limits(), image_sizes=sizes)
    call = dict(prompt=p.prompt, negative_prompt=p.negative_prompt, num_frames=p.num_frames, num_inference_steps=3,
                generator=torch.Generator().manual_seed(p.seed))
    call.update(dict(image=image) if image is not None else dict(height=p.height, width=p.width))
    return p, call


@pytest.mark.parametrize("name", list(CASES))
def test_serving_equals_the_pipeline(name, dirs, record_property):
    case = CASES[name]
    model_dir = dirs(case["model"])
    eng, pipe = _MODELS.engine(model_dir), _MODELS.pipe(model_dir)
    image = picture(*case["image"]) if "image" in case else None
    p, call = request(eng, case, image)
    if image is not None:  # the bucket nearest the image's aspect: not the image's own size
        assert (p.height, p.width) != image.size[::-1]
    pipe.guider = pipe.guider.new(guidance_scale=p.guidance_scale)  # the request's scale on the directory's guider
    lat = eng.run(p, image=image).output_latents()
    ref = pipe(**call, output_type="latent").frames
    frames = eng.frames(lat, p)
    call["generator"] = torch.Generator().manual_seed(p.seed)
    shown = pipe(**call, output_type="pt").frames
    diffs = {"latents": max_diff(lat, ref), "frames": max_diff(frames[0], shown[0].permute(0, 2, 3, 1))}
    record_property("diffs", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_glyph_path_and_guidance_are_not_vacuous(dirs):
    """Quoted text reaches ByT5 (a mask with real tokens, other latents than the unquoted prompt's), and the
    guidance scale changes the result."""
    eng = _MODELS.engine(dirs("tiny-hunyuan-video15"))
    wire = eng.encoder.wire_tensors([QUOTED, "a shop sign in the rain"], 1000)
    assert wire[0][GLYPH_MASK.name].sum() > 0 and wire[1][GLYPH_MASK.name].sum() == 0
    runs = {}
    for name, body in {"quoted": dict(prompt=QUOTED), "plain": dict(prompt=QUOTED.replace('"', "")),
                       "g3": dict(prompt=QUOTED, guidance_scale=3.0)}.items():
        p, _ = request(eng, body, None)
        runs[name] = eng.run(p).output_latents()
    assert max_diff(runs["quoted"], runs["plain"]) > 1e-3
    assert max_diff(runs["quoted"], runs["g3"]) > 1e-3


def test_defaults_follow_the_directory(dirs):
    """The guider's scale is the default guidance_scale; a real directory's default size is the pipeline's 16:9
    bucket of its target_size (the built-in's serving defaults override it)."""
    from common.families import read_model
    from common.families.hunyuan_video15.binding import HUNYUAN_VIDEO15

    info = read_model(dirs("hv15-test-x"))
    assert info.defaults["guidance_scale"] == X.guider_scale
    made = HUNYUAN_VIDEO15.pipeline_defaults(info.transformer_config, info.family.latents.geometry(info.path,
                                                                                                  info.transformer_config))
    assert made["guidance_scale"] == X.guider_scale and made["height"] < made["width"]


REFUSED = {
    "true_cfg_scale": ("tiny-hunyuan-video15", dict(true_cfg_scale=4.0)),
    "guidance_scale_2": ("tiny-hunyuan-video15", dict(guidance_scale_2=2.0)),
    "max_sequence_length": ("tiny-hunyuan-video15", dict(max_sequence_length=256)),
    "image": ("tiny-hunyuan-video15", dict(image="x")),
    "mu": ("tiny-hunyuan-video15", dict(mu=0.5)),
    "last_image": ("tiny-hunyuan-video15-i2v", dict(image="x", last_image="y")),
    "num_frames": ("tiny-hunyuan-video15", dict(num_frames=6)),
    # image-to-video: the size is the aspect bucket nearest the image (the pipeline has no height or width)
    "height": ("tiny-hunyuan-video15-i2v", dict(image="x", height=64)),
    "width": ("tiny-hunyuan-video15-i2v", dict(image="x", width=96)),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_fields_the_pipeline_does_not_take_are_refused_naming_them(field, dirs):
    model, body = REFUSED[field]
    info = _MODELS.engine(dirs(model)).info
    with pytest.raises(FieldError) as e:  # the router's checks, in its order
        check_images({"prompt": "a fox", **body}, info)
        to_params({"prompt": "a fox", **body}, info, Limits(), image_sizes=[(64, 48)] if "image" in body else [])
    assert e.value.field == field


def test_image_to_video_needs_its_image(dirs):
    info = _MODELS.engine(dirs("tiny-hunyuan-video15-i2v")).info
    with pytest.raises(FieldError) as e:
        check_images({"prompt": "a fox"}, info)
    assert e.value.field == "image"


def test_only_image_to_video_is_sized_by_its_image(dirs):
    """GET /v1/models' ``sized_by_image`` (the page sends no size then): the I2V model's, not the T2V one's nor an
    edit model's, whose size follows the image only by default."""
    from router.core.request_params import sized_by_image

    assert sized_by_image(_MODELS.engine(dirs("tiny-hunyuan-video15-i2v")).info)
    assert not sized_by_image(_MODELS.engine(dirs("tiny-hunyuan-video15")).info)
    from common.families import read_model
    assert not sized_by_image(read_model(ensure_builtin("tiny-qwen-image-edit")))
