"""Factories of the VAEs several families share: ``AutoencoderKL`` (SD3's and FLUX's: 16 channels, 8x, no
quant convs) and the Wan-style causal 3D VAEs (``AutoencoderKLWan``, Wan2.1's and Wan2.2's;
``AutoencoderKLQwenImage``, Qwen-Image's, the same layout with its own class)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.builtin.build import seeded

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

    from common.builtin.spec import KLVaeSizes

LATENT_CHANNELS = 16
# Wan's VAEs: three 2x spatial downsamplings (8x), the last two also 2x in time (4x).
WAN_TEMPORAL_DOWNSAMPLE = (False, True, True)


def autoencoder_kl(spec: KLVaeSizes, sample_size: int, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """``AutoencoderKL`` of the spec's widths (:class:`common.builtin.spec.KLVaeSizes`) with 16 latent channels,
    ``sample_size`` pixels and the family's latent normalisation."""
    from diffusers import AutoencoderKL

    levels = len(spec.vae_block_out_channels)
    config = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=spec.vae_block_out_channels,
        layers_per_block=spec.vae_layers_per_block,
        act_fn="silu",
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=spec.vae_norm_num_groups,
        sample_size=sample_size,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return seeded(spec, "vae", lambda: AutoencoderKL(**config))


def wan_vae_config(base_dim: int, dim_mult: tuple[int, ...], num_res_blocks: int) -> dict:
    """``AutoencoderKLWan`` / ``AutoencoderKLQwenImage`` arguments: the real strides (8x spatial, 4x temporal,
    z_dim 16) and default latent statistics, with these widths."""
    return dict(
        base_dim=base_dim,
        z_dim=LATENT_CHANNELS,
        dim_mult=list(dim_mult),
        num_res_blocks=num_res_blocks,
        attn_scales=[],
        temperal_downsample=list(WAN_TEMPORAL_DOWNSAMPLE),
        dropout=0.0,
    )


def wan_vae(spec, config: dict, cls: str = "AutoencoderKLWan"):
    """The diffusers VAE class ``cls`` of ``config`` (:func:`wan_vae_config`, maybe extended)."""
    import diffusers

    return seeded(spec, "vae", lambda: getattr(diffusers, cls)(**config))
