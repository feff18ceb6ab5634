"""The built-in LTX-2 models load and run in diffusers' own pipelines (text-to-video and image-to-video), with
non-trivial VAE statistics, and spatio-temporal guidance on the default block changes the result."""

from __future__ import annotations

import json

import numpy as np
import torch

from common.builtin import ensure_builtin

CALL = dict(prompt="a red fox", negative_prompt="blurry", height=64, width=64, num_frames=9, num_inference_steps=2,
            max_sequence_length=64, output_type="np")


def test_tiny_ltx2_runs_and_stg_perturbs_its_default_block():
    from diffusers import LTX2Pipeline

    path = ensure_builtin("tiny-ltx2")
    defaults = json.loads((path / "serving_defaults.json").read_text())
    pipe = LTX2Pipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.transformer.config.in_channels == pipe.transformer.config.audio_in_channels
    for vae in (pipe.vae, pipe.audio_vae):
        assert not torch.equal(vae.latents_mean, torch.zeros_like(vae.latents_mean))
        assert not torch.equal(vae.latents_std, torch.ones_like(vae.latents_std))

    def run(blocks):
        return pipe(**CALL, stg_scale=1.0, spatio_temporal_guidance_blocks=blocks,
                    generator=torch.Generator().manual_seed(0))

    out = run([defaults["stg_block"]])
    assert out.frames.shape == (1, 9, 64, 64, 3) and out.audio.shape[:2] == (1, 2)
    assert np.isfinite(out.frames).all() and torch.isfinite(out.audio).all()
    beyond = run([pipe.transformer.config.num_layers])  # a block that does not exist: STG perturbs nothing
    assert np.abs(out.frames - beyond.frames).max() > 1e-3


def test_tiny_ltx2_i2v_runs():
    import PIL.Image
    from diffusers import LTX2ImageToVideoPipeline

    path = ensure_builtin("tiny-ltx2-i2v")
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "LTX2ImageToVideoPipeline"
    pipe = LTX2ImageToVideoPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    image = PIL.Image.fromarray(np.full((40, 60, 3), 120, dtype=np.uint8))
    out = pipe(image=image, **CALL, spatio_temporal_guidance_blocks=[1], generator=torch.Generator().manual_seed(0))
    assert out.frames.shape == (1, 9, 64, 64, 3) and np.isfinite(out.frames).all()
