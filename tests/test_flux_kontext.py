"""FLUX.1 Kontext in process: the built-ins, the image side and the output size against diffusers'
``FluxKontextPipeline`` on the same directory (the pipeline's own ``prepare_latents`` outputs, captured).

1. Built-ins: ``tiny-flux-kontext`` and ``small-flux-kontext`` are ``FluxKontextPipeline`` directories laid out
   as FLUX.1-Kontext-dev (guidance-embedded transformer, dynamic shifting, no IP-adapter image encoder).
2. The image side: ``reference_latents`` equal the pipeline's packed ``image_latents`` and ``reference_grids``
   its image ids' grid, on images of other sizes and aspects, with and without ``auto_resize``, on the
   built-in and on a configuration of other VAE widths.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import PIL.Image
import pytest
import torch

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.flux_kontext import SPECS, TinyFluxKontextSpec
from common.families.flux.kontext_images import KontextConditioner
from common.protocol.messages import REFERENCE_GRIDS, REFERENCE_LATENTS
from family_harness import DTYPE, ModuleModels, max_diff

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


def picture(height: int, width: int, seed: int = 0) -> PIL.Image.Image:
    """A smooth RGB image (a gradient plus noise), so that resampling matters."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1)
    return PIL.Image.fromarray(((0.7 * base + 0.3 * rng.rand(height, width, 3)) * 255).astype(np.uint8))


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
    wire = images.wire_tensors([image], 64, 64, {"auto_resize": auto_resize})
    ref = pipeline_reference(path, image, auto_resize, height=64, width=64)
    assert max_diff(wire[REFERENCE_LATENTS.name], ref["image_latents"][0]) <= TOL
    (rows, cols), = wire[REFERENCE_GRIDS.name].tolist()
    ids = ref["image_ids"]
    assert wire[REFERENCE_GRIDS.name].dtype == torch.int64 and ids.shape[0] == rows * cols
    assert (ids[:, 1].max().item() + 1, ids[:, 2].max().item() + 1) == (rows, cols)
    if not auto_resize:  # the image's own size, rounded down to whole tokens
        assert (rows, cols) == (size[0] // 16, size[1] // 16)
