"""Model directories whose VAE downsamples other than 8x, in process against diffusers' pipelines on the same
directory: a 4x ``AutoencoderKL`` (three levels) under SD3, FLUX.1, FLUX.1 Kontext and Z-Image, a 4x
``AutoencoderKLFlux2`` under FLUX.2 [klein] (with a reference image), 4x and 16x ``AutoencoderKLQwenImage``
(three and five levels) under Qwen-Image and Qwen-Image-Edit / Edit-Plus (two images), an 8x
``AutoencoderKLHunyuanVideo15`` under HunyuanVideo 1.5.

1. Each is served equal to its pipeline (latents, and frames where the pipeline has a step callback, within
   1e-4) through the router's conversion of the request, at a size the pipeline runs as asked: on the VAEs
   below 16x a multiple of 8 that is no multiple of 16 (refused while the size rule assumed an 8x VAE); on
   the 16x one with references whose token grids are their pixels / 32 (their tokens did not fit grids of
   pixels / 16: a 500).
2. The request-size rule (the router's conversion, ``to_params``) takes exactly the sizes the pipeline's own
   ``check_inputs`` takes without an error or a "resized accordingly" warning, on these directories and on
   the 8x built-ins; every other size is refused naming ``height`` or ``width``; over HTTP a 400 with the
   field, and /openapi.json's ``multipleOf`` is the directory's.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.builtin import ensure_builtin
from common.builtin.specs import (flux, flux2_klein, flux_kontext, hunyuan_video15, qwen_image, qwen_image_edit, sd3,
                                  z_image)
from common.config.engine import Limits
from common.diffusion.params import FieldError, to_params
from common.families import read_model
from family_harness import ModuleModels, max_diff
from pipeline_reference import pipeline_call, pipeline_for

TOLERANCE = 1e-4
models = ModuleModels()

# Three AutoencoderKL levels: 4x. Five AutoencoderKLQwenImage levels: 16x (a narrow one: every reference is
# encoded at a 1024x1024 area).
SD3_4X = dataclasses.replace(sd3.SPECS["tiny-sd3"], name="vae4x-sd3", vae_block_out_channels=(4, 4, 8), seed=7)
FLUX_4X = dataclasses.replace(flux.SPECS["tiny-flux"], name="vae4x-flux", vae_block_out_channels=(4, 4, 8), seed=7)
KONTEXT_4X = dataclasses.replace(flux_kontext.SPECS["tiny-flux-kontext"], name="vae4x-flux-kontext",
                                 vae_block_out_channels=(4, 4, 8), seed=7)
Z_IMAGE_4X = dataclasses.replace(z_image.SPECS["tiny-z-image"], name="vae4x-z-image", vae_block_out_channels=(4, 4, 8),
                                 seed=7)
KLEIN_4X = dataclasses.replace(flux2_klein.SPECS["tiny-flux2-klein"], name="vae4x-flux2-klein",
                               vae_block_out_channels=(8, 8, 16), seed=7)
QWEN_IMAGE_4X = dataclasses.replace(qwen_image.SPECS["tiny-qwen-image"], name="vae4x-qwen-image",
                                    vae_dim_mult=(1, 2, 4), seed=7)




@dataclasses.dataclass(frozen=True)
class HunyuanVideo15At8x(hunyuan_video15.TinyHunyuanVideo15Spec):
    VAE_SPATIAL_COMPRESSION = 8


components = hunyuan_video15.components  # what build() calls in the module of a spec's class
_HUNYUAN = hunyuan_video15.SPECS["tiny-hunyuan-video15"]
HUNYUAN_8X = HunyuanVideo15At8x(**{**{f.name: getattr(_HUNYUAN, f.name) for f in dataclasses.fields(_HUNYUAN)},
                                   "name": "vae8x-hunyuan-video15", "seed": 7})
QWEN_16X = dict(vae_base_dim=2, vae_dim_mult=(1, 1, 1, 1, 1), seed=7)
EDIT_16X = dataclasses.replace(qwen_image_edit.SPECS["tiny-qwen-image-edit"], name="vae16x-qwen-image-edit",
                               **QWEN_16X)
PLUS_16X = dataclasses.replace(qwen_image_edit.SPECS["tiny-qwen-image-edit-plus"],
                               name="vae16x-qwen-image-edit-plus", **QWEN_16X)


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def picture(height: int, width: int, seed: int):
    from PIL import Image

    coarse = np.random.RandomState(seed).randint(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BILINEAR)


def pipe_for(path: Path):
    if str(path) not in models.pipes:  # (laid out as the engine's: pipeline_for)
        models.pipes[str(path)] = pipeline_for(path)
    return models.pipes[str(path)]


def diffusers_output(path: Path, info, p, images: list, call: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pipeline's final latents (from its step callback) and frames [F, H, W, 3] for request ``p``; a
    pipeline without a step callback (HunyuanVideo 1.5's): its latent output, and no frames."""
    pipe, seen = pipe_for(path), {}
    given = {"image": images if len(images) > 1 else images[0]} if images else None
    args = {**pipeline_call(pipe, info, p, given), **call}
    if "callback_on_step_end" not in inspect.signature(pipe.__call__).parameters:
        return pipe(**args, output_type="latent").frames, None

    def last_latents(pipe_, i, t, kwargs):
        seen["latents"] = kwargs["latents"]
        return {}

    out = pipe(**args, output_type="np", callback_on_step_end=last_latents,
               callback_on_step_end_tensor_inputs=["latents"])
    return seen["latents"], torch.from_numpy(np.asarray(out.images))


# name: (spec, the request, its images' (height, width), the pipeline's arguments the request has no name for)
PARITY = {
    "sd3-4x": (SD3_4X, dict(height=40, width=56, guidance_scale=4.5, negative_prompt="blurry"), [], {}),
    "flux-4x": (FLUX_4X, dict(height=56, width=40, guidance_scale=3.5), [], {}),
    # The output made at max_area 48x48 at the asked aspect: 40x56 (a 4x VAE's 8-pixel cells).
    "kontext-4x": (KONTEXT_4X, dict(height=40, width=56, max_area=48 * 48, auto_resize=False), [(44, 60)],
                   {"_auto_resize": False}),
    "z-image-4x": (Z_IMAGE_4X, dict(height=40, width=56, guidance_scale=4.0, negative_prompt="blurry"), [], {}),
    "flux2-klein-4x": (KLEIN_4X, dict(height=56, width=40, guidance_scale=4.0), [(70, 90)], {}),
    "qwen-image-4x": (QWEN_IMAGE_4X, dict(height=40, width=56, true_cfg_scale=4.0, negative_prompt="blurry"), [], {}),
    "hunyuan-video15-8x": (HUNYUAN_8X, dict(height=40, width=56, num_frames=5), [], {}),
    "qwen-edit-16x": (EDIT_16X, dict(height=64, width=96, true_cfg_scale=1.0), [(90, 60)], {}),
    "qwen-edit-plus-16x": (PLUS_16X, dict(height=96, width=64, true_cfg_scale=3.0, negative_prompt="dark"),
                           [(200, 300), (150, 120)], {}),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_served_equal_to_the_pipeline(case):
    spec, over, sizes, call = PARITY[case]
    path = ensure_builtin(spec)
    eng = models.engine(path)
    info, images = eng.info, [picture(h, w, i) for i, (h, w) in enumerate(sizes)]
    # The router's conversion takes the request (the size rule of the directory's own VAE).
    p = to_params({"prompt": "a red fox in the snow", "num_inference_steps": 2, "seed": 3, **over}, info, Limits(),
                  image_sizes=[im.size for im in images])
    made = info.family.latents.size(info, p.height, p.width, p.fields)
    cell = info.vae_scale_spatial * info.patch_size[-1]
    if cell < 16:  # a rule fixed for an 8x VAE (multiples of max(16, cell)) refused the size made
        assert made[0] % 16 and made[0] % cell == 0
    task = eng.run(p, image=images or None)
    if info.vae_scale_spatial > 8:  # each reference's grid: its 1024x1024-area size / (16 * 2), recomputed
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

        grids = [calculate_dimensions(1024 * 1024, w / h)[:2] for h, w in sizes]
        assert list(task.image.grids) == [(gh // 32, gw // 32) for gw, gh in grids]
    ref_latents, ref_frames = diffusers_output(path, info, p, images, call)
    d_lat = max_diff(task.latents, ref_latents)
    d_img = 0.0 if ref_frames is None else max_diff(eng.frames(task.latents, p)[:, 0], ref_frames)
    assert ref_frames is None or ref_frames.shape == (1, *made, 3)
    print(f"\n[{case}] {made[0]}x{made[1]}: latents {d_lat:.3g} frames {d_img:.3g}")
    assert d_lat <= TOLERANCE and d_img <= TOLERANCE


# --- 2. the request-size rule is the pipeline's -------------------------------------------------------------

def pipeline_takes(pipe, height: int, width: int) -> bool:
    """Whether the pipeline's own ``check_inputs`` takes the size without an error or a warning (the FLUX and
    Qwen-Image pipelines warn, then round the size down)."""
    logger = sys.modules[type(pipe).__module__].logger
    params = inspect.signature(pipe.check_inputs).parameters
    args = {n: None for n, a in params.items() if a.default is inspect.Parameter.empty}
    args.update({"guidance_scale": 1.0} if "guidance_scale" in params else {})  # (FLUX.2 [klein] compares it)
    warned = []
    original, logger.warning = logger.warning, lambda *a, **k: warned.append(a)
    try:
        pipe.check_inputs(**{**args, "prompt": "a fox", "height": height, "width": width})
    except ValueError:
        return False
    finally:
        logger.warning = original
    return not warned


SIZE_RULE = {"sd3-4x": (SD3_4X, 8), "flux-4x": (FLUX_4X, 8), "flux2-klein-4x": (KLEIN_4X, 8),
             "qwen-image-4x": (QWEN_IMAGE_4X, 8), "qwen-edit-16x": (EDIT_16X, 32),
             "tiny-sd3": ("tiny-sd3", 16), "tiny-flux": ("tiny-flux", 16)}


@pytest.mark.parametrize("which", list(SIZE_RULE))
def test_size_rule_is_the_pipelines(which):
    spec, multiple = SIZE_RULE[which]
    path = ensure_builtin(spec)
    info, pipe = read_model(path), pipe_for(path)
    taken = set()
    for side in range(4, 100, 4):
        for height, width in ((side, 64), (64, side)):
            request = {"prompt": "a fox", "height": height, "width": width}
            try:
                to_params(request, info, Limits())
                ok = True
            except FieldError as e:
                ok = False
                assert e.field == ("height" if height != 64 else "width"), e
                assert "multiple of" in e.message
            assert ok == pipeline_takes(pipe, height, width), (height, width)
            taken |= {side} if ok and width == 64 else set()
    assert sorted(taken) == list(range(multiple, 100, multiple))


def test_refusal_is_a_400_naming_the_field_and_openapi_says_the_multiple(tmp_path):
    from fastapi.testclient import TestClient

    from common.config.engine import EngineConfig
    from common.config.topology import parse_topology
    from router.api.app import create_app
    from router.core.engine import Engine
    from router.link.dispatcher import Dispatcher

    path = ensure_builtin(SD3_4X)
    config = EngineConfig(model=str(path), workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path),
                          router_endpoint=f"ipc://{tmp_path}/router.sock", runtime_dir=str(tmp_path),
                          limits=Limits(data_dir=str(tmp_path / "jobs")))
    app = create_app(Engine(config, Dispatcher(config)))
    r = TestClient(app).post("/generate", json={"prompt": "a fox", "height": 44, "width": 40})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["field"] == "height" and "multiple of 8, got 44" in error["message"]
    height = app.openapi()["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    size = next(b for b in height["properties"]["height"].get("anyOf", [height["properties"]["height"]])
                if b.get("type") != "null")
    assert (size["minimum"], size["multipleOf"]) == (8, 8)
