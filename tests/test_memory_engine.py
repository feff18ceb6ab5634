"""Memory settings through a launched engine: tiny-sd3 with ``--vae-tiling auto --vae-tiling-pixels 4096
--text-encoder-device cpu``.

A 64 x 64 image (4096 pixels, the budget) decodes whole and equals diffusers' untiled decode of the engine's own
latents; a 128 x 128 one decodes tiled (AutoencoderKL's tiles are its sample_size, 64 here) and equals
diffusers' tiled decode of them. Every answer reports each stage's peak memory. On a GPU machine, a second
engine with its text encoder on the host: the encoder worker allocates nothing on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor

from common.builtin import ensure_builtin
from conftest import Engine
from router.client import EngineClient

REQ = dict(prompt="a fox at dawn", negative_prompt="blurry", seed=3, num_inference_steps=2, guidance_scale=4.5)
BUDGET = 64 * 64


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    engine = Engine(tmp_path_factory.mktemp("memory"), "tiny-sd3", "encoder=1,denoise=1,decode=1",
                    ["--vae-tiling", "auto", "--vae-tiling-pixels", str(BUDGET), "--text-encoder-device", "cpu"])
    with EngineClient(engine.url) as c:
        yield c
    engine.stop()


def _diffusers_decode(latents: torch.Tensor, tiled: bool) -> torch.Tensor:
    """StableDiffusion3Pipeline's decode of latents [16, H', W'] with the VAE tiled or not: frames [1, H, W, 3]."""
    vae = AutoencoderKL.from_pretrained(ensure_builtin("tiny-sd3") / "vae", dtype=torch.float32).eval()
    if tiled:
        vae.enable_tiling()
    with torch.no_grad():
        image = vae.decode(latents[None] / vae.config.scaling_factor + vae.config.shift_factor).sample
    return VaeImageProcessor(vae_scale_factor=8).postprocess(image, output_type="pt").permute(0, 2, 3, 1)


@pytest.mark.parametrize("size, tiled", [(64, False), (128, True)], ids=["at-the-budget-whole", "above-it-tiled"])
def test_decode_tiles_above_the_budget_as_diffusers_does(client, size, tiled):
    req = {**REQ, "height": size, "width": size}
    answer = client.generate(**req)
    frames = answer["samples"][0]["output"]
    latents = client.generate(**req, output_type="latent")["samples"][0]["output"]
    assert frames.shape == (1, size, size, 3)
    assert (frames - _diffusers_decode(latents, tiled)).abs().max() <= 1e-5
    if tiled:  # the other way differs: the tiles took effect (random weights: their seams differ by up to ~1)
        assert (frames - _diffusers_decode(latents, False)).abs().max() > 1e-2
    peaks = answer["peak_memory"]
    assert set(peaks) == {"encoder", "denoise", "decode"} and all(v > 10 << 20 for v in peaks.values()), peaks


def test_latent_answers_report_no_decode_peak(client):
    peaks = client.generate(**REQ, output_type="latent")["peak_memory"]
    assert peaks["decode"] is None and peaks["encoder"] > 0 and peaks["denoise"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_text_encoder_on_the_host_leaves_the_encoders_gpu_untouched(tmp_path):
    """On a GPU machine every worker is on cuda:0; the text encoder alone runs on the host."""
    engine = Engine(tmp_path, "tiny", "encoder=1,denoise=1,decode=1", ["--text-encoder-device", "cpu"])
    try:
        with EngineClient(engine.url) as c:
            answer = c.generate(prompt="a fox at dawn", seed=1)
    finally:
        engine.stop()
    assert answer["samples"][0]["output"].std() > 1e-3
    peaks = answer["peak_memory"]
    assert peaks["encoder"] == 0 and peaks["denoise"] > 0 and peaks["decode"] > 0  # torch's CUDA bytes
