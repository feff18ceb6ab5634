"""FLUX.2 [klein] in process (tests/family_harness.py) against diffusers' ``Flux2KleinPipeline`` on the same
directory, prompt and seed.

1. Built-ins: ``tiny-flux2-klein`` (base: CFG) and ``small-flux2-klein`` (step-distilled) load as
   ``Flux2KleinPipeline`` with its exact component classes.
2. Serving equals the pipeline within 1e-4, the final packed latents (captured by the pipeline's step-end
   callback) and the frames: CFG on (the empty prompt as negative) and off, a non-square size, a configuration
   other than the built-in's (other widths, text layers, rotary axes, VAE), a distilled one whose default
   guidance is off where the pipeline ignores its 4.0, and edits with reference images that the pipeline crops
   to whole cells or resizes to its 1024x1024 area (two references: their ids' t coordinates 10 and 20).
3. Refusals through the one request conversion (``TrainerPolicy.params``): a negative prompt, guidance above 1
   on a distilled model, too many images, a field of other families: each a ``FieldError`` naming the field.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.flux2_klein import SPECS
from common.diffusion.params import FieldError
from family_harness import DTYPE, ModuleModels, gradient_picture, max_diff

TOL = 1e-4
# Other widths, text layers, rotary axes, VAE and seed than the built-in's.
KLEIN_X = dataclasses.replace(
    SPECS["tiny-flux2-klein"], name="klein-test-x", seed=7, text_hidden_size=24, text_num_layers=28,
    text_num_heads=3, text_num_kv_heads=1, text_head_dim=8, num_layers=2, num_single_layers=2,
    num_attention_heads=3, attention_head_dim=24, axes_dims_rope=(4, 8, 8, 4), latent_channels=4,
    vae_block_out_channels=(8, 16, 16, 16), vae_norm_num_groups=8, num_inference_steps=3, max_sequence_length=40)
KLEIN_X_DISTILLED = dataclasses.replace(KLEIN_X, name="klein-test-x-distilled", is_distilled=True, guidance_scale=1.0)

models = ModuleModels()
_DIRS: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from models.module_scope(_DIRS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    def get(which: str):
        if which not in _DIRS:
            spec = {"x": KLEIN_X, "x-distilled": KLEIN_X_DISTILLED}.get(which)
            _DIRS[which] = ensure_builtin(which) if spec is None else build_builtin(spec, tmp_path_factory.mktemp(which))
        return _DIRS[which]
    return get


def pipeline_run(model_dir, p, guidance_scale: float, images=None):
    """The pipeline's final packed latents (its step-end callback) and its frames [1, 1, H, W, 3]."""
    seen = {}

    def keep(pipe, i, t, kwargs):
        seen["latents"] = kwargs["latents"].clone()
        return {}

    out = models.pipe(model_dir)(
        image=images, prompt=p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
        guidance_scale=guidance_scale, max_sequence_length=p.max_sequence_length,
        generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np", callback_on_step_end=keep)
    return seen["latents"], torch.from_numpy(out.images)[:, None]


def test_builtins_are_the_pipelines_directories():
    import json

    for name, distilled in (("tiny-flux2-klein", False), ("small-flux2-klein", True)):
        index = json.loads((ensure_builtin(name) / "model_index.json").read_text())
        assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is distilled
        assert index["text_encoder"] == ["transformers", "Qwen3ForCausalLM"]
        assert index["transformer"] == ["diffusers", "Flux2Transformer2DModel"]
        assert index["vae"] == ["diffusers", "AutoencoderKLFlux2"]
        assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert {"tiny-flux2-klein", "small-flux2-klein"} <= set(BUILTINS)


# (model, request over the serving defaults, the pipeline's guidance_scale; None: the request's)
CASES = {
    "builtin-cfg": ("tiny-flux2-klein", {}, None),
    "builtin-no-guidance": ("tiny-flux2-klein", dict(guidance_scale=1.0), None),
    "builtin-non-square-cfg": ("tiny-flux2-klein", dict(height=48, width=80, guidance_scale=2.5, seed=3), None),
    "x-cfg-non-square": ("x", dict(height=80, width=32, guidance_scale=5.0, prompt="a lighthouse at dusk"), None),
    "x-distilled-default": ("x-distilled", dict(seed=5), 4.0),  # the pipeline ignores its default 4.0
}


@pytest.mark.parametrize("case", list(CASES))
def test_serving_equals_the_pipeline(case, dirs, record_property):
    which, over, pipe_scale = CASES[case]
    model_dir = dirs(which)
    eng = models.engine(model_dir)
    p = eng.params(**over)
    task = eng.run(p)
    assert (task.uncond is not None) == (p.guidance_scale > 1 and not which.endswith("distilled"))
    want_latents, want_frames = pipeline_run(model_dir, p, p.guidance_scale if pipe_scale is None else pipe_scale)
    got_frames = eng.frames(task.latents, p)
    diffs = {"latents": max_diff(task.latents, want_latents), "frames": max_diff(got_frames, want_frames)}
    record_property("diffs", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs


# (model, reference image sizes (width, height), request over the defaults)
EDITS = {
    # 70x100 is cropped to 64x96; the output takes that size (no height / width given).
    "builtin-cropped-size-from-image": ("tiny-flux2-klein", [(70, 100)], dict(height=None, width=None)),
    # 1100x1000 is resized to the 1024x1024 area first; a second, small reference after it.
    "x-resized-two-references": ("x", [(1100, 1000), (72, 64)], dict(height=48, width=64, guidance_scale=3.0)),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_an_edit_equals_the_pipeline(case, dirs, record_property):
    which, sizes, over = EDITS[case]
    model_dir = dirs(which)
    eng = models.engine(model_dir)
    images = [gradient_picture(h, w, seed=k) for k, (w, h) in enumerate(sizes)]
    trainer = models.trainer(model_dir)
    asked = {k: v for k, v in over.items() if v is not None}
    made = trainer.params("a red fox in the snow", image=images, **asked)
    p = eng.params(**{**asked, "height": made.height, "width": made.width})
    task = eng.run(p, image=images)
    want_latents, want_frames = pipeline_run(model_dir, p, p.guidance_scale, images)
    diffs = {"latents": max_diff(task.latents, want_latents), "frames": max_diff(eng.frames(task.latents, p), want_frames)}
    record_property("diffs", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs
    if "height" not in asked:  # the first image's encoded size, as the pipeline's height = height or image_height
        assert (p.height, p.width) == (96, 64) and want_frames.shape[2:4] == (96, 64)


@pytest.mark.parametrize("fields, field", [
    (dict(negative_prompt="blurry"), "negative_prompt"),
    (dict(negative_prompt=""), "negative_prompt"),
    (dict(true_cfg_scale=4.0), "true_cfg_scale"),
    (dict(num_frames=5), "num_frames"),
    (dict(max_sequence_length=513), "max_sequence_length"),
])
def test_fields_the_pipeline_does_not_take_are_refused(fields, field):
    trainer = models.trainer(ensure_builtin("tiny-flux2-klein"))
    with pytest.raises(FieldError) as e:
        trainer.params("a fox", **fields)
    assert e.value.field == field


def test_a_distilled_model_refuses_guidance_and_defaults_to_none(dirs):
    trainer = models.trainer(dirs("x-distilled"))
    assert trainer.params("a fox").guidance_scale == 1.0  # KLEIN_X_DISTILLED's serving default
    with pytest.raises(FieldError) as e:
        trainer.params("a fox", guidance_scale=4.0)
    assert e.value.field == "guidance_scale" and "distilled" in e.value.message
    assert trainer.params("a fox", guidance_scale=1.0).guidance_scale == 1.0


def test_too_many_references_are_refused():
    from common.diffusion.params import check_images

    info = models.trainer(ensure_builtin("tiny-flux2-klein")).info  # (the router's check, before the images load)
    check_images({"image": ["a"] * 3}, info)
    with pytest.raises(FieldError) as e:
        check_images({"image": ["a"] * 4}, info)
    assert e.value.field == "image"


@pytest.mark.parametrize("sizes, field", [([(40, 96)], "image"), ([(96, 96), (600, 70)], "image[1]")])
def test_references_the_pipeline_refuses_are_refused_naming_them(sizes, field):
    """``Flux2ImageProcessor.check_image_input``'s rule (sides of 64 or more, aspect at most 8) at the router,
    before a worker sees the image; the sizes it passes are served."""
    from common.config.engine import Limits
    from common.diffusion.params import to_params

    info = models.trainer(ensure_builtin("tiny-flux2-klein")).info
    with pytest.raises(FieldError) as e:
        to_params({"prompt": "a fox"}, info, Limits(), image_sizes=sizes)
    assert e.value.field == field
    assert to_params({"prompt": "a fox"}, info, Limits(), image_sizes=[(64, 512), (96, 96)]).height == 512
