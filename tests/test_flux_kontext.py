"""FLUX.1 Kontext in process: the built-ins, the image side and the output size against diffusers'
``FluxKontextPipeline`` on the same directory (the pipeline's own ``prepare_latents`` outputs, captured).

1. Built-ins: ``tiny-flux-kontext`` and ``small-flux-kontext`` are ``FluxKontextPipeline`` directories laid out
   as FLUX.1-Kontext-dev (guidance-embedded transformer, dynamic shifting, no IP-adapter image encoder).
2. The image side: ``reference_latents`` equal the pipeline's packed ``image_latents`` and ``reference_grids``
   its image ids' grid, on images of other sizes and aspects, with and without ``auto_resize``, on the
   built-in and on a configuration of other VAE widths.
3. The output size: the pipeline's ``max_area`` at the asked aspect (the model's serving default, or the
   request's ``max_area``); bad ``max_area`` / ``auto_resize`` values are a 400 naming the field.
4. Serving (the workers' path, tests/family_harness.py) equals ``FluxKontextPipeline`` on the same directory,
   image, prompt and seed within 1e-4 (packed latents and frames): auto-resize on and off, images of other
   sizes and aspects, a non-square output, true CFG on and off, a configuration other than the built-in, and
   a request without an image (the pipeline's text-to-image path); the reference tokens' position ids are the
   pipeline's (first coordinate 1).
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.flux_kontext import SPECS, TinyFluxKontextSpec
from common.families.flux.kontext_images import KontextConditioner
from common.diffusion.parts.reference import REFERENCE_GRIDS, REFERENCE_LATENTS
from common.runtime.component_memory import settle_held
from family_harness import DTYPE, ModuleModels, max_diff
from family_harness import gradient_picture as picture

TOL = 1e-4
# Other widths, rotary axes, text encoders, VAE and shift settings than the built-in's.
KONTEXT_X = dataclasses.replace(
    SPECS["tiny-flux-kontext"], name="kontext-test-x", num_layers=2, num_single_layers=1, num_attention_heads=3,
    attention_head_dim=12, axes_dims_rope=(2, 4, 6), clip_l_hidden_size=24, clip_l_num_heads=3,
    clip_l_intermediate_size=40, t5_d_model=40, t5_d_kv=8, t5_d_ff=56, t5_num_heads=5,
    vae_block_out_channels=(8, 8, 16, 16), vae_norm_num_groups=8, base_shift=0.3, max_shift=1.4,
    base_image_seq_len=8, max_image_seq_len=64, seed=5, num_inference_steps=3, max_sequence_length=24,
    max_area=48 * 80)

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
                            else build_builtin(KONTEXT_X, tmp_path_factory.mktemp(which)))
        return _DIRS[which]
    return get



def kontext_pipe(model_dir):
    """diffusers' ``FluxKontextPipeline`` on ``model_dir``, laid out as the engine's weights."""
    from diffusers import FluxKontextPipeline

    from conftest import reference_pipeline

    if str(model_dir) not in _MODELS.pipes:
        _MODELS.pipes[str(model_dir)] = reference_pipeline(FluxKontextPipeline.from_pretrained(model_dir, dtype=DTYPE))
    return _MODELS.pipes[str(model_dir)]


class _Seen(Exception):
    """Stops a pipeline call once its latents are prepared."""


def pipeline_reference(model_dir, image, auto_resize: bool, **call):
    """The pipeline's packed image latents [1, T, C] and image ids [T, 3] for ``image``, from its own
    ``prepare_latents`` (the call stopped there: no step is needed)."""
    pipe = kontext_pipe(model_dir)
    seen = {}
    original = pipe.prepare_latents

    def capture(*args, **kwargs):
        out = original(*args, **kwargs)
        seen["latents"], seen["image_latents"], seen["latent_ids"], seen["image_ids"] = out
        raise _Seen
    pipe.prepare_latents = capture
    try:
        pipe(image=image, prompt="make it red", num_inference_steps=1, output_type="latent", max_sequence_length=8,
             _auto_resize=auto_resize, generator=torch.Generator().manual_seed(0), **call)
    except _Seen:
        pass
    finally:
        del pipe.prepare_latents
    return seen


# --- 1. built-ins ------------------------------------------------------------------------------------------------

def test_builtins_are_kontext_dev_directories(dirs):
    for name in ("tiny-flux-kontext", "small-flux-kontext"):
        assert BUILTINS[name] is SPECS[name] and isinstance(SPECS[name], TinyFluxKontextSpec)
    path = dirs("tiny-flux-kontext")
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "FluxKontextPipeline"
    assert index["image_encoder"] == [None, None] and index["feature_extractor"] == [None, None]
    assert json.loads((path / "transformer" / "config.json").read_text())["guidance_embeds"] is True
    assert json.loads((path / "scheduler" / "scheduler_config.json").read_text())["use_dynamic_shifting"] is True
    assert json.loads((path / "serving_defaults.json").read_text())["max_area"] == SPECS["tiny-flux-kontext"].max_area
    with pytest.raises(ValueError, match="max_area"):
        dataclasses.replace(SPECS["tiny-flux-kontext"], max_area=100)


# --- 2. the image side -------------------------------------------------------------------------------------------

# Each model with either setting, on a wide and a tall image (sizes not multiples of 16).
@pytest.mark.parametrize("which, auto_resize, size", [
    ("tiny-flux-kontext", True, (75, 130)), ("tiny-flux-kontext", False, (200, 90)),
    ("kontext-x", True, (200, 90)), ("kontext-x", False, (75, 130))])
def test_reference_tokens_equal_the_pipelines(dirs, which, auto_resize, size):
    path = dirs(which)
    image = picture(*size, seed=size[0])
    images = KontextConditioner.load(SimpleNamespace(path=path), DTYPE, torch.device("cpu"))
    settle_held(images=images)  # laid out as the encoder worker's (and as reference_pipeline lays out diffusers')
    wire = images.wire_tensors([image], 64, 64, {"auto_resize": auto_resize})
    ref = pipeline_reference(path, image, auto_resize, height=64, width=64)
    assert max_diff(wire[REFERENCE_LATENTS.name], ref["image_latents"][0]) <= TOL
    (rows, cols), = wire[REFERENCE_GRIDS.name].tolist()
    ids = ref["image_ids"]
    assert wire[REFERENCE_GRIDS.name].dtype == torch.int64 and ids.shape[0] == rows * cols
    assert (ids[:, 1].max().item() + 1, ids[:, 2].max().item() + 1) == (rows, cols)
    if not auto_resize:  # the image's own size, rounded down to whole tokens
        assert (rows, cols) == (size[0] // 16, size[1] // 16)


# --- 3. the output size ------------------------------------------------------------------------------------------

def test_output_size_is_max_area_at_the_asked_aspect(dirs):
    from common.families.flux.kontext_size import kontext_size

    eng = _MODELS.engine(dirs("tiny-flux-kontext"))
    size = eng.family.latents.size
    assert size(eng.info, 1024, 1024, {}) == (64, 64)  # the serving default's 64x64 area, whatever the size asked
    assert size(eng.info, 48, 96, {}) == (32, 80)  # round(sqrt(4096 * 2)) = 91 -> 80, round(sqrt(2048)) = 45 -> 32
    assert size(eng.info, 64, 64, {"max_area": 128 * 128}) == (128, 128)
    pipe = kontext_pipe(dirs("tiny-flux-kontext"))
    for h, w, area in ((48, 96, 4096), (100, 37, 9000)):  # the pipeline's noise token count at each
        out = pipe(prompt="x", height=h, width=w, max_area=area, num_inference_steps=1, max_sequence_length=8,
                   output_type="latent", generator=torch.Generator().manual_seed(0)).images
        rows, cols = size(eng.info, h, w, {"max_area": area})
        assert out.shape[1] == (rows // 16) * (cols // 16) and (rows, cols) == kontext_size(h, w, area, 16)


@pytest.mark.parametrize("body, field", [({"max_area": 100}, "max_area"), ({"max_area": 2.5}, "max_area"),
                                         ({"auto_resize": "yes"}, "auto_resize"), ({"max_area": 20, "height": 64}, "max_area")])
def test_bad_fields_are_400s_naming_them(dirs, body, field):
    from common.config.engine import Limits
    from router.core.errors import FieldError
    from router.request.schemas import GenerateBody
    from router.core.request_params import to_params

    eng = _MODELS.engine(dirs("tiny-flux-kontext"))
    with pytest.raises(FieldError) as e:
        to_params(GenerateBody(prompt="x", **body), eng.info, Limits())
    assert e.value.field == field


def test_fields_reach_the_params(dirs):
    from common.config.engine import Limits
    from router.request.schemas import GenerateBody
    from router.core.request_params import to_params

    eng = _MODELS.engine(dirs("tiny-flux-kontext"))
    p = to_params(GenerateBody(prompt="x", max_area=9000, auto_resize=False), eng.info, Limits())
    assert p.fields["max_area"] == 9000 and p.fields["auto_resize"] is False
    p = to_params(GenerateBody(prompt="x"), eng.info, Limits())
    assert p.fields["max_area"] == SPECS["tiny-flux-kontext"].max_area and p.fields["auto_resize"] is True


# --- 4. serving against the pipeline -----------------------------------------------------------------------------

# (model, image size or None, request fields): every case differs from the built-in's default request somewhere.
PARITY = {
    "auto-resize": ("tiny-flux-kontext", (75, 130), {}),
    "own-size-wide-output": ("tiny-flux-kontext", (200, 90), dict(auto_resize=False, height=48, width=96)),
    "x-true-cfg": ("kontext-x", (90, 60), dict(true_cfg_scale=4.0, negative_prompt="blurry", height=80, width=48)),
    "x-own-size-area": ("kontext-x", (130, 75), dict(auto_resize=False, max_area=64 * 64, height=64, width=96)),
    "no-image": ("tiny-flux-kontext", None, dict(height=64, width=32)),
}


def pipeline_output(model_dir, p, image, output_type: str):
    f = p.fields
    guided = f.get("true_cfg_scale", 1.0) > 1
    torch.set_num_threads(_MODELS.engine(model_dir).max_threads)  # as the engine's image encode (see below)
    out = kontext_pipe(model_dir)(
        image=image, prompt=p.prompt, negative_prompt=p.negative_prompt if guided else None,
        true_cfg_scale=f.get("true_cfg_scale", 1.0), guidance_scale=p.guidance_scale, height=p.height, width=p.width,
        max_area=f.get("max_area", SPECS["tiny-flux-kontext"].max_area if "tiny" in str(model_dir) else KONTEXT_X.max_area),
        _auto_resize=f.get("auto_resize", True), num_inference_steps=p.num_inference_steps,
        max_sequence_length=p.max_sequence_length, generator=torch.Generator("cpu").manual_seed(p.seed),
        output_type=output_type).images
    return out if output_type == "latent" else torch.from_numpy(np.asarray(out))


@pytest.mark.parametrize("case", list(PARITY))
def test_serving_equals_the_pipeline(case, dirs, record_property):
    which, size, over = PARITY[case]
    path = dirs(which)
    eng = _MODELS.engine(path)
    p = eng.params(**over)
    image = None if size is None else picture(*size, seed=3)
    # The same thread count for both image encodes: a 1 MP reference's VAE encode rounds differently on
    # another (1.7e-3 on the tiny VAE), and the workers' forwards leave the count at theirs.
    torch.set_num_threads(eng.max_threads)
    task = eng.run(p, image=image)
    made = eng.family.latents.size(eng.info, p.height, p.width, p.fields)
    assert task.latents.shape == (1, (made[0] // 16) * (made[1] // 16), 64)  # the noise tokens only
    frames = eng.frames(task.latents, p)
    ref_latents, ref_frames = pipeline_output(path, p, image, "latent"), pipeline_output(path, p, image, "np")
    assert frames.shape == (1, 1, *made, 3) and ref_frames.shape == (1, *made, 3)
    d_lat, d_img = max_diff(task.latents, ref_latents), max_diff(frames[:, 0], ref_frames)
    record_property("max_diff", {"latents": d_lat, "frames": d_img})
    print(f"\n[{case}] {made} latents {d_lat:.3g} frames {d_img:.3g}")
    assert frames.std() > 1e-3 and d_lat <= TOL and d_img <= TOL


def test_the_reference_changes_the_output_and_its_ids_are_the_pipelines(dirs):
    from common.diffusion.parts.reference import TokenLayout
    from common.families.flux.kontext import layout_ids

    path = dirs("tiny-flux-kontext")
    eng = _MODELS.engine(path)
    p = eng.params(auto_resize=False)
    a, b = eng.run(p, image=picture(64, 96, seed=1)).latents, eng.run(p, image=picture(64, 96, seed=2)).latents
    assert max_diff(a, b) > 1e-3  # the reference tokens are attended to
    ref = pipeline_reference(path, picture(75, 130), False, height=64, width=64, max_area=64 * 64)
    ids = layout_ids(TokenLayout((4, 4), ((75 // 16, 130 // 16),)), torch.device("cpu"), DTYPE)
    assert torch.equal(ids, torch.cat([ref["latent_ids"], ref["image_ids"]]))
