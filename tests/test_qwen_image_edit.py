"""Qwen-Image-Edit and Qwen-Image-Edit-Plus served in process (the encoder worker's text and image sides, the
denoise worker's reference tokens, the decode) against diffusers' own pipelines on the same directory, images,
prompt and seed: packed latents and frames within 1e-4. Images of other sizes and aspects than the output
(resized as the pipelines resize them), Plus with two and three images, true CFG on and off, the default size
from the images, and a configuration other than the built-in ones (other widths, a ``zero_cond_t``
transformer: the reference tokens at timestep 0)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin import ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.qwen_image_edit import SPECS
from common.families.qwen_image.processor import load_processor
from family_harness import DTYPE, InProcess, ModuleModels, max_diff

TOLERANCE = 1e-4
models = ModuleModels()
_DIRS: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope(_DIRS)


def picture(height: int, width: int, seed: int) -> Image.Image:
    """A smooth random picture (a coarse grid upsampled), so that resizing it keeps its content."""
    coarse = np.random.RandomState(seed).randint(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BILINEAR)


def model_dir(which: str, tmp_path_factory) -> Path:
    if which not in _DIRS:
        if which == "other":  # Plus with other widths and a zero_cond_t transformer
            spec = dataclasses.replace(SPECS["tiny-qwen-image-edit-plus"], name="qwen-edit-other", num_layers=1,
                                       num_attention_heads=3, attention_head_dim=24, axes_dims_rope=(8, 8, 8),
                                       zero_cond_t=True, processor_max_tokens=20, seed=3)
            _DIRS[which] = build_builtin(spec, tmp_path_factory.mktemp("qwen-edit-other"))
        else:
            _DIRS[which] = ensure_builtin(which)
    return _DIRS[which]


def pipe_for(path: Path):
    """diffusers' pipeline on ``path`` with the processor loaded as the engine loads it (no torchvision here)."""
    import diffusers
    from conftest import reference_pipeline

    from common.families import read_model

    if str(path) not in models.pipes:
        cls = getattr(diffusers, read_model(path).family.pipeline)
        pipe = cls.from_pretrained(path, processor=load_processor(path), dtype=DTYPE)
        models.pipes[str(path)] = reference_pipeline(pipe)
    return models.pipes[str(path)]


def diffusers_output(path: Path, p, images: list, sized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's packed final latents (from its step callback) and frames [1, H, W, 3] for request ``p``;
    ``sized`` False leaves height and width to the pipeline (its default from the images)."""
    pipe = pipe_for(path)
    guided = p.fields.get("true_cfg_scale", 1.0) > 1
    seen = {}

    def last_latents(pipe_, i, t, kwargs):
        seen["latents"] = kwargs["latents"]
        return {}

    out = pipe(image=images if len(images) > 1 else images[0], prompt=p.prompt,
               negative_prompt=p.negative_prompt if guided else None, true_cfg_scale=p.fields.get("true_cfg_scale"),
               height=p.height if sized else None, width=p.width if sized else None,
               num_inference_steps=p.num_inference_steps, generator=torch.Generator("cpu").manual_seed(p.seed),
               output_type="np", callback_on_step_end=last_latents, callback_on_step_end_tensor_inputs=["latents"])
    return seen["latents"], torch.from_numpy(np.asarray(out.images))


PARITY = {
    # One image of another size and aspect than the output (resized to the 1024x1024 area), true CFG.
    "edit-cfg": ("tiny-qwen-image-edit", [(200, 300)], dict(height=48, width=80, true_cfg_scale=4.0,
                                                               negative_prompt="blurry", seed=1)),
    "edit-no-cfg": ("tiny-qwen-image-edit", [(90, 60)], dict(height=64, width=32, seed=2)),
    "plus-2-cfg": ("tiny-qwen-image-edit-plus", [(200, 300), (150, 120)],
                   dict(height=64, width=48, true_cfg_scale=3.0, negative_prompt="dark", seed=3)),
    "plus-3-no-cfg": ("tiny-qwen-image-edit-plus", [(200, 300), (150, 120), (64, 200)],
                      dict(height=32, width=64, seed=4)),
    "other-config-2-cfg": ("other", [(120, 160), (200, 100)],
                           dict(height=48, width=48, true_cfg_scale=4.0, negative_prompt="noisy", seed=5)),
    # No size given: the output at the 1024x1024 area of the first (Edit) image's aspect.
    "edit-default-size": ("tiny-qwen-image-edit", [(100, 140)], dict(seed=6)),
}
HEAVY = {"plus-3-no-cfg", "edit-default-size", "other-config-2-cfg", "edit-no-cfg"}  # each >5 s; the built-ins' cases cover it


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c in HEAVY else c for c in PARITY])
def test_serving_equals_diffusers(case, tmp_path_factory, record_property):
    which, sizes, over = PARITY[case]
    path = model_dir(which, tmp_path_factory)
    eng = models.engine(path)
    images = [picture(h, w, seed) for seed, (h, w) in enumerate(sizes)]
    sized = "height" in over
    if not sized:  # as the router: the family's default size from the images' (width, height)
        height, width = eng.family.condition.default_size(eng.info, [im.size for im in images], {})
        over = {**over, "height": height, "width": width}
    if "negative_prompt" not in over:
        over = {**over, "true_cfg_scale": 1.0}
    p = eng.params(num_inference_steps=2, prompt="turn the fox blue", **over)
    task = eng.run(p, image=images)
    seq = (p.height // 16) * (p.width // 16)
    assert task.latents.shape == (1, seq, 64)  # the noise tokens alone
    ref_latents, ref_frames = diffusers_output(path, p, images, sized)
    frames = eng.frames(task.latents, p)
    assert ref_frames.shape == (1, p.height, p.width, 3)
    d_lat, d_img = max_diff(task.latents, ref_latents), max_diff(frames[:, 0], ref_frames)
    record_property("max_diff", {"latents": d_lat, "frames": d_img})
    print(f"\n[{case}] latents {d_lat:.3g} frames {d_img:.3g}")
    assert d_lat <= TOLERANCE and d_img <= TOLERANCE
    # The references condition the output: another last image changes it.
    other = eng.run(p, image=images[:-1] + [picture(*sizes[-1], 9)])
    assert max_diff(other.latents, task.latents) > 1e-3
