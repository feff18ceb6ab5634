"""Z-Image served equal to diffusers' ``ZImagePipeline``: latents and frames on the built-in and on another
configuration, with and without guidance, a non-square size, the Turbo setting, ``cfg_normalization`` and
``cfg_truncation``; its refusals name their field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.z_image import SPECS
from common.config.engine import Limits
from common.diffusion.params import FieldError, to_params
from family_harness import ModuleModels, max_diff

TOL = 1e-4
# Other widths, depth, refiners, text encoder, VAE and shift than the built-in's.
Z_X = dataclasses.replace(SPECS["tiny-z-image"], name="z-image-test-x", dim=48, n_heads=3, n_kv_heads=3,
                          n_layers=3, n_refiner_layers=2, text_hidden_size=48, text_num_layers=3, text_num_heads=3,
                          text_num_kv_heads=3, text_head_dim=16, vae_block_out_channels=(4, 8, 8, 8), shift=6.0,
                          seed=7)
OTHER = {Z_X.name: Z_X}
_MODELS = ModuleModels()
_DIRS: dict[str, object] = {}

CASES = {
    "cfg": dict(model="tiny-z-image", guidance_scale=5.0),
    # Z-Image-Turbo's setting: 8 steps, no guidance (one row per sample)
    "turbo": dict(model="tiny-z-image", guidance_scale=0.0, num_inference_steps=8),
    # the pipeline's cfg_normalization=True, and guidance off after the first two of four steps
    "norm-trunc": dict(model="tiny-z-image", guidance_scale=4.0, cfg_normalization=True, cfg_truncation=0.2),
    # another configuration, a non-square size, a norm ratio that bites less
    "x-tall": dict(model="z-image-test-x", guidance_scale=3.0, height=96, width=64, cfg_normalization=1.3),
    "x-wide-unguided": dict(model="z-image-test-x", guidance_scale=0.0, height=48, width=80),
}


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


def request(eng, case: dict):
    """The case as the engine's params (through the router's conversion) and as the pipeline's call."""
    body = {"prompt": "a red fox in the snow", "negative_prompt": "blurry, dark", "seed": 5, "num_inference_steps": 4,
            **{k: v for k, v in case.items() if k != "model"}}
    p = to_params(body, eng.info, Limits())
    call = dict(prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                max_sequence_length=p.max_sequence_length,
                cfg_normalization=case.get("cfg_normalization", False), cfg_truncation=case.get("cfg_truncation", 1.0))
    return p, call


@pytest.mark.parametrize("name", list(CASES))
def test_serving_equals_the_pipeline(name, dirs, record_property):
    case = CASES[name]
    model_dir = dirs(case["model"])
    eng, pipe = _MODELS.engine(model_dir), _MODELS.pipe(model_dir)
    p, call = request(eng, case)
    task = eng.run(p)
    lat = task.output_latents()
    ref = pipe(**call, generator=torch.Generator().manual_seed(p.seed), output_type="latent").images
    frames = eng.frames(lat, p)
    shown = pipe(**call, generator=torch.Generator().manual_seed(p.seed), output_type="pt").images
    diffs = {"latents": max_diff(lat, ref), "frames": max_diff(frames[:, 0], shown.permute(0, 2, 3, 1))}
    record_property("diffs", diffs)
    assert frames.shape == (1, 1, p.height, p.width, 3) and frames.std() > 1e-3
    assert all(d <= TOL for d in diffs.values()), diffs


def test_turbo_runs_one_row_per_sample(dirs):
    """guidance_scale 0: no negative pass at all (a request of two samples, one forward of two rows a step)."""
    eng = _MODELS.engine(dirs("tiny-z-image"))
    p, _ = request(eng, dict(guidance_scale=0.0, num_inference_steps=2, n=2))
    task = eng.task(p)
    assert task.uncond is None and task.model_input().row_count == 2


def test_each_guidance_setting_changes_the_result(dirs):
    """Not a vacuous match: normalisation and truncation each move the latents, and a guidance of 0 differs
    from any guidance above it."""
    eng = _MODELS.engine(dirs("tiny-z-image"))
    runs = {name: eng.run(request(eng, over)[0]).output_latents() for name, over in {
        "cfg": dict(guidance_scale=4.0), "norm": dict(guidance_scale=4.0, cfg_normalization=0.5),
        "trunc": dict(guidance_scale=4.0, cfg_truncation=0.2), "off": dict(guidance_scale=0.0)}.items()}
    for name in ("norm", "trunc", "off"):
        assert max_diff(runs[name], runs["cfg"]) > 1e-3, name


@pytest.mark.parametrize("body, field", [
    ({"true_cfg_scale": 2.0}, "true_cfg_scale"), ({"guidance_scale": -1.0}, "guidance_scale"),
    ({"cfg_truncation": 1.5}, "cfg_truncation"), ({"cfg_normalization": "yes"}, "cfg_normalization"),
    ({"cfg_normalization": -1.0}, "cfg_normalization"), ({"height": 72}, "height"),
    ({"max_sequence_length": 600}, "max_sequence_length"), ({"num_frames": 5}, "num_frames")])
def test_refusals_name_their_field(body, field, dirs):
    model_dir = dirs("tiny-z-image")
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    with pytest.raises(FieldError) as e:
        to_params({"prompt": "a fox", **body}, eng.info, Limits())
    assert e.value.field == field, e.value
    with pytest.raises(FieldError) as e:
        trainer.params("a fox", **body)
    assert e.value.field == field, e.value
