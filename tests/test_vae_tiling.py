"""VAE tiling in process: the policy (auto switches at its budget), every family's decoder and every image side
that VAE-encodes a request's image (image-to-video's first frame, FLUX.2 [klein]'s references) honouring it, and
tiled equal to untiled within diffusers' own tolerance.

diffusers' pipeline tests (``test_vae_tiling``) decode a 128 x 128 output whole and in 96-pixel tiles 64 apart
with their dummy VAEs and accept a largest difference of 0.2 (``expected_diff_max``) in the pipeline's [0, 1]
output; the same VAEs, sizes and tiles through our decoders must do as well. The built-in random-weight VAEs
tile too (their seams differ far more: random weights spread a latent's influence wider than trained ones).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderDC, AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan
from diffusers.video_processor import VideoProcessor
from PIL import Image

from common.diffusion.vae_tiling import DEFAULT_TILING_PIXELS, VaeTiling
from common.families import read_model
from common.builtin import ensure_builtin
from common.families.qwen_image.vae import QwenImageDecoder
from common.families.sana.vae import SanaDecoder
from common.diffusion.parts.decoder import AutoencoderKLDecoder
from common.families.wan.vae import WanDecoder
from common.families.wan.image import WanImageConditioner

DIFFUSERS_TILING_TOLERANCE = 0.2  # diffusers' test_vae_tiling expected_diff_max, frames in [0, 1]


def _seeded(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def _count_calls(vae, method: str) -> list:
    """Record each call of ``vae.<method>`` (diffusers' tiled path) and run it."""
    calls, original = [], getattr(vae, method)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(vae, method, counted)
    return calls


# --- the policy ---------------------------------------------------------------------------------------------
def test_auto_tiles_above_its_budget_only():
    tiling = VaeTiling("auto", 5 * 64 * 64)
    assert not tiling.tiled(5, 64, 64)  # at the budget: whole
    assert tiling.tiled(5, 64, 65) and tiling.tiled(9, 64, 64)
    assert VaeTiling("on").tiled(1, 8, 8) and not VaeTiling("off").tiled(999, 4096, 4096)
    assert VaeTiling.of("auto", None) == VaeTiling("auto", DEFAULT_TILING_PIXELS)
    assert not VaeTiling().tiled(81, 480, 832) and VaeTiling().tiled(81, 720, 1280)  # Wan's 480p whole, 720p tiled


@pytest.mark.parametrize("mode, pixels", [("sometimes", 10), ("auto", 0)])
def test_bad_settings_are_refused(mode, pixels):
    with pytest.raises(ValueError, match="vae tiling"):
        VaeTiling(mode, pixels)


# --- every family's decoder honours it ------------------------------------------------------------------------
def _wan_latents(info, h, w, frames):
    return _seeded((1, info.latent_channels, (frames - 1) // info.vae_scale_temporal + 1, h // info.vae_scale_spatial,
                    w // info.vae_scale_spatial))


def _packed_latents(info, h, w, frames):
    rows, cols = info.family.latents.token_grid(info, h, w)
    return _seeded((1, rows * cols, info.latent_channels * 4))


def _wan_tiles(vae):  # 48-pixel tiles 32 apart: 2 x 2 tiles on 64 x 64
    vae.enable_tiling(48, 48, 32, 32)


def _kl_tiles(vae):  # AutoencoderKL's tile is its config's sample_size (tiny-flux's: 1024); a quarter overlaps
    vae.tile_sample_min_size, vae.tile_latent_min_size = 48, 6


def _drawn_latents(info, h, w, frames):  # the family's own noise layout, packed as its denoiser holds latents
    part = info.family.latents
    return part.pack(_seeded(part.noise_shape(info, h, w, frames)), info, h, w)


FAMILY_CASES = {  # built-in model: its latents for a size, tiles smaller than the size, frames, size
    "tiny": (_wan_latents, _wan_tiles, 5, 64),
    "tiny-wan-ti2v": (_wan_latents, lambda vae: vae.enable_tiling(96, 96, 64, 64), 1, 128),  # a 16x VAE
    "tiny-sd3": (lambda info, h, w, f: _seeded((1, info.latent_channels, h // 8, w // 8)), _kl_tiles, 1, 64),
    "tiny-flux": (_packed_latents, _kl_tiles, 1, 64),
    "tiny-qwen-image": (_packed_latents, _wan_tiles, 1, 64),
    "tiny-sana": (lambda info, h, w, f: _seeded((1, info.latent_channels, h // info.vae_scale_spatial,
                                                 w // info.vae_scale_spatial)),
                  lambda vae: vae.enable_tiling(96, 96, 64, 64), 1, 128),  # a 32x VAE: 2 x 2 tiles of 3 latents
    "tiny-z-image": (_drawn_latents, _kl_tiles, 1, 64),
    "tiny-flux2-klein": (_drawn_latents, _kl_tiles, 1, 64),  # AutoencoderKLFlux2 tiles as AutoencoderKL
    "tiny-hunyuan-video15": (_drawn_latents, lambda vae: vae.enable_tiling(64, 64, 4, 4), 1, 96),  # 16x: 2 x 2 tiles
}


@pytest.mark.parametrize("model", sorted(FAMILY_CASES))
def test_each_family_decoder_tiles_above_the_budget(model):
    latents_for, tiles, frames, size = FAMILY_CASES[model]
    info = read_model(ensure_builtin(model))
    pixels = frames * size * size
    latents = latents_for(info, size, size, frames)
    out = {}
    for budget in (pixels, pixels - 1):  # "on" and "off" take the same path (VaeTiling.tiled above)
        decoder = info.family.decoder.load(info, torch.float32, "cpu", VaeTiling("auto", budget))
        tiles(decoder.vae)
        calls = _count_calls(decoder.vae, "tiled_decode")
        out[budget] = decoder.decode(info.family.latents.unpack(latents, info, size, size), size, size)
        assert len(calls) == (budget < pixels)
    assert out[pixels].shape == (1, frames, size, size, 3)
    assert not torch.equal(out[pixels - 1], out[pixels])


# --- tiled equals untiled within diffusers' tolerance ----------------------------------------------------------
# diffusers' pipeline tests' dummy VAEs (seed 0) and their tiles.
def _dummy_wan():
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _diffusers_test_tiles(vae):
    vae.enable_tiling(tile_sample_min_height=96, tile_sample_min_width=96, tile_sample_stride_height=64,
                      tile_sample_stride_width=64)


def _dummy_kl():
    torch.manual_seed(0)
    return AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
                         latent_channels=4, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035).eval()


def _dummy_qwen_image():
    torch.manual_seed(0)
    return AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                  temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                  latents_std=[1.0] * 4).eval()


def _dummy_dc():  # diffusers' SANA pipeline test's (two levels: 2x)
    torch.manual_seed(0)
    return AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=2,
                         encoder_block_types=("ResBlock", "EfficientViTBlock"),
                         decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 8),
                         decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)),
                         decoder_qkv_multiscales=((), (5,)), encoder_layers_per_block=(1, 1),
                         decoder_layers_per_block=[1, 1], downsample_block_type="conv",
                         upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
                         scaling_factor=0.41407).eval()


def _tiled_and_whole(make_decoder, latents, *size) -> tuple[torch.Tensor, torch.Tensor]:
    whole = make_decoder(VaeTiling("off")).decode(latents, *size)
    tiled_decoder = make_decoder(VaeTiling("on"))
    calls = _count_calls(tiled_decoder.vae, "tiled_decode")
    tiled = tiled_decoder.decode(latents, *size)
    assert calls and tiled.shape == whole.shape
    return tiled, whole


def _tiles_like_diffusers(make_vae, tiles=_diffusers_test_tiles):
    vae = make_vae()
    tiles(vae)
    return vae


def test_wan_tiled_decode_within_diffusers_tolerance():
    tiled, whole = _tiled_and_whole(lambda t: WanDecoder(_tiles_like_diffusers(_dummy_wan), "cpu", t),
                                    _seeded((1, 16, 2, 16, 16)))  # 5 frames of 128 x 128
    assert tiled.shape == (1, 5, 128, 128, 3)
    assert (tiled - whole).abs().max() < DIFFUSERS_TILING_TOLERANCE  # measured 0.091


def test_sd3_and_flux_tiled_decode_within_diffusers_tolerance():
    # AutoencoderKL's tiles are its sample_size (32 here) with a quarter overlap; FLUX decodes through SD3's decoder.
    tiled, whole = _tiled_and_whole(lambda t: AutoencoderKLDecoder(_tiles_like_diffusers(_dummy_kl, lambda v: None), "cpu", t),
                                    _seeded((1, 4, 128, 128)))
    assert tiled.shape == (1, 1, 128, 128, 3)
    assert (tiled - whole).abs().max() < DIFFUSERS_TILING_TOLERANCE  # measured 0.143


def test_qwen_image_tiled_decode_within_diffusers_tolerance():
    info = read_model(ensure_builtin("tiny-qwen-image"))  # its token grid: 256 px are 16 x 16 tokens
    tiled, whole = _tiled_and_whole(
        lambda t: QwenImageDecoder(_tiles_like_diffusers(_dummy_qwen_image), "cpu", t),
        info.family.latents.unpack(_seeded((1, 256, 16)), info, 256, 256), 256, 256)  # the dummy VAE is 4x: 32 x 32 latents, 128 x 128 pixels
    assert tiled.shape == (1, 1, 128, 128, 3)
    assert (tiled - whole).abs().max() < DIFFUSERS_TILING_TOLERANCE  # measured 0.086


def test_sana_tiled_decode_within_diffusers_tolerance():
    tiled, whole = _tiled_and_whole(lambda t: SanaDecoder(_tiles_like_diffusers(_dummy_dc), "cpu", t),
                                    _seeded((1, 4, 64, 64)), 128, 128)
    assert tiled.shape == (1, 1, 128, 128, 3)
    assert (tiled - whole).abs().max() < DIFFUSERS_TILING_TOLERANCE  # measured 0.062


# --- image to video: the encoder half ------------------------------------------------------------------------
def _picture(size: int) -> Image.Image:
    g = torch.Generator().manual_seed(1)
    smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 8, 8, generator=g), size=(size, size), mode="bilinear")
    return Image.fromarray((smooth[0].permute(1, 2, 0) * 255).round().byte().numpy())


def test_image_to_video_encode_tiles_as_told():
    vae = _tiles_like_diffusers(_dummy_wan)
    vae.decoder = None  # as the encoder worker holds it

    def condition(tiling: VaeTiling):
        conditioner = WanImageConditioner(vae, VideoProcessor(vae_scale_factor=8), None, None, False, "cpu", tiling)
        calls = _count_calls(vae, "tiled_encode")
        return conditioner.condition(_picture(160), None, 128, 128, 9), len(calls)

    whole, whole_calls = condition(VaeTiling("auto", 9 * 128 * 128))
    tiled, tiled_calls = condition(VaeTiling("auto", 9 * 128 * 128 - 1))
    assert (whole_calls, tiled_calls) == (0, 1)
    assert tiled.shape == whole.shape == (4 + 16, 3, 16, 16)
    assert torch.equal(tiled[:4], whole[:4])  # the first-frame mask
    # The latents' own spread is about 1; the seams move them by a small part of it.
    scale = whole[4:].abs().max()
    assert (tiled[4:] - whole[4:]).abs().max() < DIFFUSERS_TILING_TOLERANCE * scale


# Per model whose image side VAE-encodes a request's image (beside Wan's above): its tiles on that VAE, the size,
# the VAE's tiled path.
IMAGE_SIDE_CASES = {
    "tiny-hunyuan-video15-i2v": (lambda vae: vae.enable_tiling(32, 32, 2, 2), 96, "tiled_encode"),  # frame 0's (its 64 px bucket)
    "tiny-flux2-klein": (_kl_tiles, 64, "_tiled_encode"),  # a reference image's tokens
}


@pytest.mark.parametrize("model", sorted(IMAGE_SIDE_CASES))
def test_each_image_side_encodes_tiled_above_the_budget_only(model):
    from common.config.engine import Limits
    from common.diffusion.params import to_params

    tiles, size, tiled_path = IMAGE_SIDE_CASES[model]
    info = read_model(ensure_builtin(model))
    picture = _picture(size)
    from router.core.request_params import sized_by_image

    by_image = sized_by_image(info)  # (HunyuanVideo 1.5 I2V: the frame is encoded at the image's bucket)
    asked = {} if by_image else {"height": size, "width": size}
    p = to_params({"prompt": "a fox", **asked, "num_frames": 1}, info, Limits(), image_sizes=[picture.size])
    pixels = p.height * p.width if by_image else size * size
    out = {}
    for budget in (pixels, pixels - 1):
        conditioner = info.family.condition.load(info, torch.float32, "cpu", VaeTiling("auto", budget))
        tiles(conditioner.vae)
        calls = _count_calls(conditioner.vae, tiled_path)
        out[budget] = info.family.condition.wire_tensors(conditioner, [picture], None, p)
        assert len(calls) == (budget < pixels)
    assert out[pixels].keys() == out[pixels - 1].keys()
    assert any(not torch.equal(a, b) for a, b in zip(out[pixels].values(), out[pixels - 1].values()))
